"""The engine's core, cut by the process that runs each part (docs/architecture.md walks a request
through them).

Modules directly in `rxf.core` are the plugin API and the types every process shares; each is cheap
to import and touches no device:

- plugin machinery: `hookspecs` (the hooks), `registry` (loading and lookups), `config`;
- what plugins implement or call: `attention`, `forward`, `kv_pool`, `weight_loader` (models and
  kernels, used in the scheduler process), `grammar`, `chat_template`, `tool_syntax`;
- shared by the front door and the scheduler: `sampling_params`, `tokenizer_info`, `echo`.

Subpackages name their process:

- `frontend`: the main process (the HTTP server's or the `Runtime` caller's): requests prepared
  once, the TokenizerManager, data-parallel routing, typed outputs;
- `scheduler`: the scheduler process's host side (one per tensor-parallel rank): the step loop,
  admission, policy, constrained decoding, the process entry (`scheduler.process`);
- `kvcache`: the scheduler process's KV bookkeeping (the radix tree, reservations as handles);
- `runner`: the scheduler process's device side: the model runner, the step's forward and sampling,
  CUDA graphs, tensor-parallel groups;
- `speculative`: the scheduler process's speculative decoding: draft proposers (n-gram index, draft
  model) and the acceptance rule;
- `detokenizer`: the detokenizer process;
- `ipc`: what crosses between them (typed messages, their codec, the socket addresses);
- `launch`: starting and watching the child processes (in the main process), each child's entry,
  and the logging every process sets up.

No module here imports `rxf.entrypoints`, `rxf.plugins` or `rxf.testing`: plugins are reached only
through the registry (`tests/unit/test_layout.py`).
"""
