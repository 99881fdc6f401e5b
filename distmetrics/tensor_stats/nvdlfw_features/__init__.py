"""distmetrics' feature namespace for nvdlfw-inspect (``distmetrics_stats.py``), loaded by
nvdlfw-inspect from this folder by path; a package so that it installs with the rest."""
