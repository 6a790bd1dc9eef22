"""The `triton` attention backend: extend and split-KV decode kernels over the page-size-1 pool.

Nothing is imported here, so naming the backend (or probing it for "auto") does not import Triton;
see `backend.py` for the backend and `extend.py` / `decode.py` for the kernels.
"""
