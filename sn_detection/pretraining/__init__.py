"""Image-classification pretraining of the ResNet of a detection config (``tools/pretrain_backbone.py``):
its config keys (``config``), the data (``data``), the network and the backbone checkpoint it leaves
(``model``), the training (``train``), and the cached backbone of the demo.

The package imports none of its modules: ``config`` depends only on ``sn_detection.layers`` and is what
``sn_detection.d2.add_sn_config`` calls, while ``model`` and ``train`` build on ``sn_detection.d2``; import
each from its module (``from sn_detection.pretraining.train import pretrain``)."""
