"""KV bookkeeping in the scheduler process: the radix prefix cache over the pool's slots
(`radix_cache`) and each request's reservation as one opaque handle (`kv_manager`). The pool
itself is `rxf.core.kv_pool`, part of the plugin API (attention backends read it)."""
