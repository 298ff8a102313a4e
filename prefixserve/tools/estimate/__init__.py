"""prefixserve estimate: the offline hit-rate estimator. A trace replayed through the real KV
cache manager at several pool sizes (replay), hybrid sliding-window layouts, LoRA adapters and
replicas under each routing policy, with its tables, JSON and plots (report, results) and the
command's flags (args)."""
