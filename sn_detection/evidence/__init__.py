"""Evidence for the papers' detection claims at a scale a CPU can run.

The SN paper (Tables 3-5) claims that at 2 images per GPU Switchable Norm beats GN and BN in detection;
the DN and MGN papers make similar claims. ``tools/compare_norms.py`` (``sn_detection.engine.compare_norms``)
trains the same CPU-sized Mask R-CNN from scratch once per norm setting and seed; ``runs`` reads each run's
folder, ``report`` turns the runs' results into a table and a CSV (mean ± std over seeds), ``plots`` draws
AP per setting and the learning curves.
"""
