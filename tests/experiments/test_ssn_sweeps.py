"""SSN in the sweeps: tools/pretrain_grid.py takes it as a norm of its grid and tools/compare_norms.py as a
setting (with the batch average of its BN branch, and finetuned from an SSN backbone), the backbone cache keys
SSN's rules for SSN backbones only, and PRETRAIN.SYNC_NORMS synchronises it."""

from sn_detection.engine.launch import load_cfg
from sn_detection.experiments.compare_norms import plan as compare_plan
from sn_detection.experiments.compare_norms.plan import parse_setting, plan_runs, pretraining_configs
from sn_detection.experiments.pretrain_grid import plan as grid_plan
from sn_detection.experiments.pretrain_grid.plan import cell_cfg, parse_norms, plan_cells
from sn_detection.pretraining.cache import cache_key, cached_backbone_folder
from sn_detection.pretraining.model import backbone_cfg


def test_the_grid_pretrains_ssn_cells():
    cfg = load_cfg(grid_plan.DEFAULT_CONFIG, [])
    norms = parse_norms("SN,SSN")
    cells = plan_cells(norms, [0.1, 0.2])
    assert [cell.name for cell in cells] == ["SN-lr0.1", "SN-lr0.2", "SSN-lr0.1", "SSN-lr0.2"]
    ssn = cell_cfg(cfg, cells[2])
    assert ssn.MODEL.RESNETS.NORM == "SSN" and ssn.PRETRAIN.BASE_LR == 0.1
    assert "resnet18-SSN-" in cached_backbone_folder(ssn)


def test_the_cache_keys_ssns_rules_for_ssn_backbones_only():
    cfg = load_cfg(grid_plan.DEFAULT_CONFIG, [])
    for norm, keyed in [("SN", False), ("GN", False), ("SSN", True)]:
        base = cell_cfg(cfg, plan_cells([norm], [0.1])[0])
        other = base.clone()
        other.PRETRAIN.SSN_GATE_LR_FACTOR = 0.5
        assert ("SSN_RADIUS" in cache_key(base)["pretrain"]) == keyed, norm
        assert (cache_key(base) != cache_key(other)) == keyed, norm


def test_the_comparison_runs_ssn_settings_with_the_batch_average(tmp_path):
    cfg = load_cfg(compare_plan.DEFAULT_CONFIG, [])
    settings = [parse_setting(text) for text in ("SN", "SSN", "GN/SSN", "SSN/GN")]
    runs = plan_runs(cfg, compare_plan.DEFAULT_CONFIG, settings, [1], str(tmp_path), batch_average_batches=5)
    assert {run.setting.name: run.batch_average for run in runs} == {"SN": 5, "SSN": 5, "GN/SSN": 5, "SSN/GN": 5}
    ssn = next(run for run in runs if run.setting.name == "SSN")
    args = ssn.train_args
    assert [args[args.index(key) + 1] for key in ("MODEL.RESNETS.NORM", "MODEL.FPN.NORM")] == ["SSN", "SSN"]


def test_finetuning_starts_from_an_ssn_backbone_and_sync_norms_synchronise_it():
    cfg = load_cfg(compare_plan.DEFAULT_FINETUNE_CONFIG, [])
    configs = pretraining_configs(cfg, [parse_setting("SSN"), parse_setting("GN/SSN")])
    assert configs["SSN"].MODEL.RESNETS.NORM == "SSN" and set(configs) == {"SSN", "GN"}
    synced = configs["SSN"].clone()
    synced.PRETRAIN.SYNC_NORMS = True
    assert backbone_cfg(synced).MODEL.RESNETS.NORM == "SyncSSN"
