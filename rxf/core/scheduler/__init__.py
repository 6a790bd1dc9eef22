"""The scheduler process's host side, one process per tensor-parallel rank: the step loop
(`scheduler`: schedule -> run -> postprocess), admission, queue policy, constrained decoding, stop
checks, and the process entry behind the sockets (`process`). It deals in requests, slots and
token ids; the device work is `rxf.core.runner`'s."""
