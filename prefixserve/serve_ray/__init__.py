"""prefixserve on Ray Serve: N engine replicas behind one OpenAI-compatible HTTP entry, routed by
prefixserve's cache-aware router fed with the replicas' KV events (docs/replicas.md).

``args`` adds the ``--replicas``/``--ray-*`` flags to ``prefixserve serve``; ``launch`` starts or
joins the Ray cluster and deploys ``ingress.Ingress`` and ``replica.EngineReplica`` with
``request_router.PrefixCacheRequestRouter``. Importing this package imports no Ray."""
