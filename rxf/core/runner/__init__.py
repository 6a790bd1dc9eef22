"""The scheduler process's device side: the model runner (weights, KV pool, forward), the runner's
half of a step (`step_runner`: forward, sampling, one device-to-host copy), the scheduler-runner
interface (`step_io`), sampling and penalties, CUDA graphs, and tensor-parallel groups."""
