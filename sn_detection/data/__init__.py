"""The embedded shapes dataset: a pure generator (`shapes`, `cache`) and its detectron2 registration."""
