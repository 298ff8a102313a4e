"""``prefixserve bench``: a serving benchmark for prefix-sharing workloads.

It drives any OpenAI-compatible server through ``/v1/completions`` with streamed requests and
measures what a user of a prefix cache feels: time to first token, time per output token,
inter-token latency, end-to-end latency, throughput, and the share of prompt tokens the server
says it served from its cache.

Modules: ``datasets`` (generated workloads: shared-prefix, multi-turn, random), ``trace``
(replayed block-hash traces), ``client`` (one streamed request, Prometheus scrape), ``runner``
(arrivals, concurrency, conversations in order), ``metrics`` (the figures of a run), ``predict``
(what a perfect cache would serve of the prompts sent, by ``prefixserve estimate``), ``report``
(table, JSON, comparison, TTFT CDF plot) and ``command`` (the command line behind both
``prefixserve bench`` and ``prefixserve bench compare``).
"""
