#!/usr/bin/env python
"""Train and evaluate (COCO box and mask AP) a detectron2 model whose norms may be sn_detection's.

    tools/train_net.py --config-file configs/demo_mask_rcnn_gn.yaml [--eval-only] [--resume] \
        [--num-gpus K] [KEY VALUE ...]

`--config` works as well as `--config-file`: argparse accepts any unambiguous prefix of an option.
"""

from detectron2.engine import default_argument_parser, launch

from sn_detection.engine import main

if __name__ == "__main__":
    args = default_argument_parser().parse_args()
    launch(
        main,
        args.num_gpus,
        num_machines=args.num_machines,
        machine_rank=args.machine_rank,
        dist_url=args.dist_url,
        args=(args,),
    )
