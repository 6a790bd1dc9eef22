"""Engine configuration: pydantic-settings models read from TOML, `RXF_*` env vars and overrides.

Precedence (highest first): keyword overrides > environment (`RXF_SCHEDULER__MAX_RUNNING_REQUESTS=8`,
`__` nests) > the TOML file > defaults. Validated once at launch; the engine receives a frozen object.
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: str = Field("demo", description="Hugging Face model directory, or 'demo' for SmolLM2-135M-Instruct")
    tokenizer_path: str | None = Field(None, description="defaults to model.path")
    served_model_name: str | None = Field(None, description="the OpenAI `model` id; defaults to model.path")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    chat_template: str | None = Field(None, description="None: the model's own; a built-in name; a .jinja path")
    tool_call_parser: str | None = Field(
        None,
        description="tool-call format: 'hermes', 'llama3_json', 'mistral' or 'module:Class'; None: from the chat template",
    )
    reasoning_parser: str | None = Field(
        None,
        description="reasoning format: 'think' (alias 'qwen3', 'deepseek_r1'), 'harmony', 'module:Class' or "
        "'none'; None: from the chat template",
    )
    context_length: int | None = Field(None, gt=0, description="defaults to the checkpoint's")
    trust_remote_code: bool = False
    quantization: str | None = Field(
        None,
        description="quantization method ('fp8', 'compressed-tensors', 'awq', 'gptq', 'gguf', 'int8', 'int4', "
        "'int4-g64', 'int4-g128' or a plugin's); None: the checkpoint's quantization_config.quant_method. Set, it "
        "wins: 'fp8', 'int8' and 'int4*' on an unquantized checkpoint quantize it at load, 'gguf' reads the .gguf "
        "file in the model directory",
    )
    load_format: Literal["safetensors", "random"] = Field(
        "safetensors", description="'random': no weights read, every parameter drawn at random, biases 0 and norms 1 "
        "(benchmarks of shapes; with model.quantization = 'fp8' they are then quantized at load)"
    )
    task: Literal["generate", "embed"] = Field(
        "generate", description="'embed': serve pooled hidden states (/v1/embeddings) instead of generating text"
    )
    pooling: Literal["auto", "last", "mean"] = Field(
        "auto", description="embed: how token states pool; 'auto': the checkpoint's sentence-transformers "
        "config (1_Pooling/config.json), else the last token"
    )
    normalize: bool | None = Field(
        None, description="embed: L2-normalise embeddings; None: as the checkpoint says (a 2_Normalize module)"
    )


class AttentionConfig(_Section):
    backend: str = Field("auto", description="'auto' or a registered backend name (see `rxf plugins`)")


class SchedulerConfig(_Section):
    max_running_requests: int = Field(64, gt=0)
    max_prefill_tokens: int = Field(4096, gt=0, description="bound on one EXTEND batch's new tokens")
    chunked_prefill_size: int | Literal["off"] | None = Field(
        None,
        description="prompt tokens one step computes, all prompts together (a prompt that does not fit what is "
        "left is cut, its next chunks follow, started prompts first); 'off': a prompt in one step; "
        "unset: 256 on the CPU, max_prefill_tokens on CUDA",
    )
    @field_validator("chunked_prefill_size")
    @classmethod
    def _positive_chunk(cls, size: int | str | None) -> int | str | None:
        if isinstance(size, int) and size <= 0:
            raise ValueError("must be a positive number of tokens, or 'off'")
        return size

    mixed_chunked_prefill: bool = Field(
        True, description="run a prefill chunk in the same forward as the decoding requests"
    )
    overlap: bool | None = Field(
        None,
        description="plan and postprocess one step while the device runs the next (None: on for CUDA)",
    )
    policy: Literal["lpm", "fcfs", "random", "priority"] = Field(
        "lpm", description="waiting-queue order; 'priority': by each request's priority, lower first"
    )
    stream_interval: int = Field(1, gt=0, description="decode steps between streamed outputs")
    init_new_token_ratio: float = Field(0.7, ge=0, le=1)
    min_new_token_ratio: float = Field(0.1, ge=0, le=1)
    new_token_ratio_decay: float = Field(0.001, ge=0, le=1, description="subtracted per decode step")
    log_interval: int = Field(40, gt=0, description="decode steps between stats log lines")
    max_queued_requests: int = Field(
        1024, ge=0, description="requests that may wait beyond max_running_requests; more get 503"
    )


def chunk_size(config: SchedulerConfig, device_type: str) -> int | None:
    """Prompt tokens per step for a chunked prefill (None: no chunking). The CPU default is the
    fastest setting measured on the demo model (256: a 4000-token prompt prefills 1.9x faster than in
    one step, while 8 streams beside it wait at most 1.4 s; and as the step's budget, 16 prompts
    arriving at once get their first tokens at a median 0.3 s against 0.65 s at 512 and 1.1 s at
    1024; benchmarks/RESULTS.md)."""
    size = config.chunked_prefill_size
    if size == "off":
        return None
    if size is None:
        return 256 if device_type == "cpu" else config.max_prefill_tokens
    return size


class CacheConfig(_Section):
    disable_radix_cache: bool = False
    max_total_tokens: int | None = Field(None, gt=0, description="KV slots; default from memory")
    mem_fraction_static: float = Field(0.85, gt=0, lt=1, description="GPU: weights+KV share of memory")
    cpu_kv_cache_gb: float = Field(2.0, gt=0, description="CPU: KV budget when max_total_tokens unset")
    page_size: Literal[1] = 1
    kv_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="what the KV pool stores: 'auto' the model dtype; 'fp8_e4m3' / 'fp8_e5m2' one byte per "
        "element with per-layer scales (the checkpoint's k_scale / v_scale, else 1.0): twice the tokens of "
        "bf16 in the same memory",
    )


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    api_key: str | None = None
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    request_timeout_s: float | None = Field(
        None, gt=0, description="a request running longer is aborted and answered 504; None: no limit"
    )
    exit_on_engine_death: bool = Field(
        True, description="exit non-zero when a child process dies (false: keep answering 503)"
    )
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request")
    max_logit_bias: int = Field(300, ge=0, description="logit_bias entries per request")
    max_stop_token_ids: int = Field(1024, ge=0, description="stop_token_ids per request")
    # Slow clients. nginx's client_header_timeout, client_body_timeout and send_timeout are 60 s too:
    # a client behind a reverse proxy never meets them (the proxy sends a request at once and reads
    # the answer as it comes).
    header_timeout_s: float = Field(
        60.0, gt=0, description="a request's headers must be in within this (from the connection or its first byte): else 408"
    )
    body_timeout_s: float = Field(60.0, gt=0, description="a request's body must be in within this after its headers: else 408")
    send_timeout_s: float = Field(
        60.0, gt=0, description="a client reading nothing of its answer this long is disconnected (its request aborted)"
    )
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="an idle kept-alive connection is closed after this")
    max_connections: int = Field(
        2048, gt=0, description="open client connections; a request on one beyond them gets 503 + Retry-After"
    )
    expose_internals: bool = Field(
        False, description="without an api_key: paths, the IPC directory and the whole config in the info routes"
    )
    responses_store_entries: int = Field(
        1024, ge=0, description="responses kept for GET /v1/responses/{id} and previous_response_id (0: none)"
    )
    responses_store_ttl_s: float = Field(3600.0, gt=0, description="a stored response is forgotten this long after it ended")
    responses_store_max_mb: int = Field(
        256, gt=0, description="stored conversations' text (image data URLs too) and responses' JSON, in millions of characters"
    )


class RuntimeConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    cpu_threads: int | None = Field(
        None,
        gt=0,
        description="torch threads in the scheduler process (unset, on the CPU: every core while other processes "
        "leave them idle, one fewer while they use about half a core or more, the engine's own processes aside; chosen before each forward)",
    )
    cpu_compile: Literal["background", "startup", "off"] = Field(
        "off",
        description="CPU: compile the decode forward whole with torch.compile, for each thread count forwards may "
        "use (decode steps 1.4-1.5x faster once compiled); 'startup' waits for the graphs before serving, "
        "'background' serves at once but its forwards run 10-20x slower while the compile holds the GIL "
        "(benchmarks/RESULTS.md, issue 22)",
    )
    startup_timeout_s: float = Field(600, gt=0)
    profile_dir: str | None = Field(
        None,
        description="where /start_profile writes step profiles (each rank's step times, and optionally "
        "torch.profiler's kernel trace); unset, profiling is refused",
    )


class CudaGraphConfig(_Section):
    """Decode forwards replayed from CUDA graphs captured at startup (GPU and a backend that supports it)."""

    enabled: bool = Field(True, description="capture decode forwards as CUDA graphs on GPU")
    max_bs: int = Field(
        256, gt=0, description="largest captured batch, in rows (capped at the most rows a decode forward has: "
        "max_running_requests, or when speculating speculative.max_batch_size x (num_draft_tokens + 1))"
    )
    batch_sizes: list[int] | None = Field(
        None, description="captured batch sizes; default 1, 2, 4, then every 8 up to max_bs"
    )
    capture_budget_s: float = Field(
        30.0, gt=0, description="startup time for captures; the largest sizes that do not fit run eagerly"
    )

    @field_validator("batch_sizes")
    @classmethod
    def _positive_sizes(cls, sizes: list[int] | None) -> list[int] | None:
        if sizes is not None and (not sizes or min(sizes) < 1):
            raise ValueError("must be a non-empty list of positive batch sizes")
        return sizes


class ParallelConfig(_Section):
    """Tensor parallelism (one scheduler process per rank) and data-parallel replicas (DESIGN §9).

    A replica's `tp_size` ranks are spread evenly over `nnodes` machines; every node runs
    `tp_size // nnodes` ranks of each replica, and node 0 also runs the server, the router and the
    detokenizer. Ranks meet at `dist_init_addr` (replica d at its port + d).
    """

    tp_size: int = Field(1, gt=0, description="tensor-parallel ranks per replica")
    dp_size: int = Field(1, gt=0, description="data-parallel replicas (each with its own KV cache)")
    nnodes: int = Field(1, gt=0, description="machines one replica spans")
    node_rank: int = Field(0, ge=0, description="this machine's index among the nnodes")
    dist_init_addr: str | None = Field(
        None, description="host:port of node 0 for the process-group rendezvous; default: a free local port"
    )
    dist_backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU")

    @field_validator("dist_init_addr")
    @classmethod
    def _host_port(cls, addr: str | None) -> str | None:
        if addr is None:
            return None
        host, sep, port = addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port with a port in 1..65535")
        return addr

    @model_validator(mode="after")
    def _layout(self) -> ParallelConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be < nnodes {self.nnodes}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("dist_init_addr (node 0's host:port) is required when nnodes > 1")
        return self


class GrammarConfig(_Section):
    """Structured output (regex / json_schema / ebnf constraints) through a grammar backend plugin."""

    backend: str = Field(
        "auto", description="'auto' (xgrammar when installed), 'none' (constraints rejected), or a registered name"
    )
    cache_size: int = Field(256, ge=0, description="compiled grammars kept per process (LRU by kind and text)")
    cache_memory_mb: int = Field(512, ge=0, description="at most this much memory of compiled grammars kept per process")
    compile_threads: int = Field(
        2, gt=0, description="scheduler threads compiling grammars off the loop; also the compile worker processes"
    )
    compile_timeout_s: float = Field(
        10.0, gt=0, description="a constraint whose compile takes longer is refused (its worker process is killed)"
    )
    compile_memory_mb: int = Field(
        1024, gt=0, description="a constraint whose compile needs more memory is refused (worker address-space limit)"
    )
    jump_forward: bool = Field(
        True, description="append a grammar's only possible continuation without a forward per token"
    )
    max_match_ms: float = Field(
        50.0, gt=0, description="a request whose grammar takes longer to match one step (mask, accept, jump) ends with an error"
    )
    max_jump_forward_bytes: int = Field(
        512, gt=0, description="at most this much forced text appended per step (also cut to the request's budget)"
    )


class SpeculativeConfig(_Section):
    """Speculative decoding: propose draft tokens and verify them all in one forward of the model.

    The output is the one decoding without it gives: the same tokens under greedy sampling, the same
    distribution under temperature sampling (see `rxf/core/speculative/`)."""

    method: Literal["none", "ngram", "draft", "eagle3"] = Field(
        "none", description="'ngram': draft the continuation of the newest tokens' latest match in prompt + output; "
        "'draft': a smaller model's greedy continuation (draft_model_path); 'eagle3': an EAGLE-3 draft head "
        "(draft_model_path) fed the target's hidden states"
    )
    draft_model_path: str | None = Field(
        None, description="method 'draft': a Hugging Face directory of a model with the target's tokenizer; "
        "'eagle3': the directory of an EAGLE-3 head (LlamaForCausalLMEagle3) trained for the target"
    )
    # Defaults measured on the CPU with the demo model (benchmarks/RESULTS.md): a verify of 9 tokens
    # costs ~2.4x a decode step at batch 1 and ~3.4x at batch 8, and single-token matches mostly
    # propose wrong drafts, so a match needs 3 tokens and speculation stops above 4 decoding requests.
    num_draft_tokens: int = Field(8, gt=0, le=64, description="draft tokens proposed per request per step (at most)")
    ngram_min_match: int = Field(3, gt=0, description="shortest suffix matched against prompt + output")
    ngram_max_match: int = Field(4, gt=0, le=16, description="longest suffix matched (tried first)")
    max_batch_size: int = Field(
        4, gt=0, description="speculate only while at most this many requests decode (verifying costs more per request in larger batches)"
    )

    tree_topk: int = Field(
        1, gt=0, le=16, description="eagle3: children per expanded draft node (1: a chain of num_draft_tokens; more: "
        "a tree whose num_draft_tokens best nodes are verified at once)"
    )
    tree_depth: int = Field(
        5, gt=0, le=32, description="eagle3 with tree_topk > 1: levels of the draft tree (head forwards per step: depth - 1)"
    )

    @model_validator(mode="after")
    def _windows(self) -> SpeculativeConfig:
        if self.tree_topk > 1 and self.method != "eagle3":
            raise ValueError(f"tree_topk {self.tree_topk}: tree drafts are method 'eagle3''s (ngram and draft draw chains)")
        if self.tree_topk > self.num_draft_tokens:
            raise ValueError(f"tree_topk {self.tree_topk} must be <= num_draft_tokens {self.num_draft_tokens}")
        if (self.method in ("draft", "eagle3")) != (self.draft_model_path is not None):
            raise ValueError("draft_model_path is required by methods 'draft' and 'eagle3' and used by them only")
        if self.ngram_min_match > self.ngram_max_match:
            raise ValueError(f"ngram_min_match {self.ngram_min_match} must be <= ngram_max_match {self.ngram_max_match}")
        return self


class PluginsConfig(_Section):
    allow: list[str] | None = Field(None, description="only these plugins load (RXF_PLUGINS too)")
    deny: list[str] = Field(default_factory=list, description="these plugins never load")


class MultimodalConfig(_Section):
    """Where images and videos may come from, and how large they may be."""

    allow_local_paths: bool = Field(False, description="accept image paths / file:// URLs on this machine")
    allow_urls: bool = Field(False, description="fetch http(s) image URLs")
    url_timeout_s: float = Field(10.0, gt=0, description="per fetched URL, redirects included")
    url_max_redirects: int = Field(3, ge=0, description="redirects followed per URL (each one checked)")
    url_allow_hosts: list[str] = Field(
        [], description="host names, addresses or CIDRs fetched although loopback/private/link-local"
    )
    local_path_roots: list[str] = Field(
        [], description="with allow_local_paths, the directories files may come from (empty: anywhere)"
    )
    max_image_bytes: int = Field(20 * 2**20, gt=0, description="encoded size of one image (or video frame)")
    max_image_pixels: int = Field(40_000_000, gt=0, description="decoded width x height of one image")
    max_items_per_request: int = Field(16, gt=0, description="images + videos in one request")
    max_request_pixels: int = Field(
        160_000_000, gt=0, description="decoded width x height of a request's images and video frames together"
    )
    max_video_frames: int = Field(64, gt=0)
    video_num_frames: int = Field(
        16, gt=0, description="frames sampled evenly from a video file (at most max_video_frames; all if fewer)"
    )
    max_video_bytes: int = Field(64 * 2**20, gt=0, description="encoded size of one video file")
    max_video_decoded_frames: int = Field(
        4096, gt=0, description="frames decoded to sample one video file (keyframe seeks skip the rest)"
    )
    feature_cache_mb: int = Field(512, ge=0, description="vision features kept by image hash (scheduler)")


# The file's contents for the EngineConfig being built (a TOML source ranked below the environment).
_file_data: ContextVar[dict[str, Any] | None] = ContextVar("rxf_config_file_data", default=None)


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_file_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_data.get() or {})


class EngineConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RXF_", env_nested_delimiter="__", extra="forbid", frozen=True)

    model: ModelConfig = ModelConfig()
    attention: AttentionConfig = AttentionConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    server: ServerConfig = ServerConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    cuda_graph: CudaGraphConfig = CudaGraphConfig()
    multimodal: MultimodalConfig = MultimodalConfig()
    parallel: ParallelConfig = ParallelConfig()
    grammar: GrammarConfig = GrammarConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # NoDecode: RXF_PLUGINS is the filter string "a,b,-c" (see `_plugins_filter`), not this section as JSON.
    plugins: Annotated[PluginsConfig, NoDecode] = PluginsConfig()

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugins_filter(cls, value: Any) -> Any:
        """`RXF_PLUGINS="a,b,-c"`: allow only a and b (when any is named without "-"), deny c."""
        if not isinstance(value, str):
            return value
        from rxf.core.registry import parse_plugin_filter

        allow, deny = parse_plugin_filter(value)
        return {"allow": allow, "deny": deny}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: keyword overrides, RXF_* environment, the TOML file (or dict), defaults.
        return (init_settings, env_settings, _FileSource(settings_cls))


class ConfigError(ValueError):
    """A configuration problem, with the offending key and the file it came from."""


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"scheduler.max_running_requests": 8} or {"scheduler__max_running_requests": 8} -> nested dicts."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.replace("__", ".").split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def load_config(
    source: str | os.PathLike[str] | dict[str, Any] | EngineConfig | None = None, **overrides: Any
) -> EngineConfig:
    """Build the validated config from a TOML path, a dict, or an existing config, plus overrides.

    Overrides use dotted or `__` keys (`**{"scheduler.max_running_requests": 8}` or
    `scheduler__max_running_requests=8`) or whole sections (`model={"path": ...}`).
    """
    origin = "<dict>"
    if isinstance(source, EngineConfig):
        data = source.model_dump()
        origin = "<config object>"
    elif isinstance(source, dict):
        data = _nest(source) if any("." in k or "__" in k for k in source) else dict(source)
    elif source is None:
        data = {}
    else:
        path = Path(source)
        origin = str(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        _resolve_relative_paths(data, path.parent)
    token = _file_data.set(data)
    try:
        return EngineConfig(**_nest(overrides))
    except ValidationError as e:
        raise ConfigError(_format_errors(e, origin)) from None
    finally:
        _file_data.reset(token)


def _resolve_relative_paths(data: dict[str, Any], base: Path) -> None:
    """Model and template paths in a TOML file are relative to that file, as users expect."""
    model = data.get("model")
    if not isinstance(model, dict):
        return
    for key in ("path", "tokenizer_path", "chat_template"):
        value = model.get(key)
        if isinstance(value, str) and value.startswith(("./", "../")):
            model[key] = str((base / value).resolve())


def _format_errors(e: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration ({origin}):"]
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        lines.append(f"  {key}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err else ""))
    return "\n".join(lines)
