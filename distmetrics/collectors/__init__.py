"""Per-rank collectors: each measures and hands the reducer samples at a log step."""
