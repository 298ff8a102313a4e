"""Cache tiers below the block pool: blocks kept on disk (``disk``) and in Redis (``redis``).

Each implements the core's :class:`~prefixserve.core.tiers.KVTier` over bytes named by a
block's hash; the engine's side (what to store, when to look up, loading blocks back into the
pool) is ``prefixserve.engine.tier_manager``. Layer ``tiers``: imports only the core.
"""
