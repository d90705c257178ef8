"""Evidence for the papers' detection claims at a scale this machine can run.

The SN paper (Tables 3-5) claims that at 2 images per GPU Switchable Norm beats GN and BN in detection;
the DN and MGN papers make similar claims. ``sweep`` trains the same CPU-sized Mask R-CNN from scratch
once per norm setting and seed (``tools/compare_norms.py``), ``report`` turns the runs' results into a
table and a CSV (mean ± std over seeds), ``plots`` draws AP per setting and the learning curves.
"""
