"""The engine contract: what a replica is told (`ReplicaConfig`) and what an engine kind must know (`Engine`).

Every engine is a separate process speaking one HTTP protocol (docs/design.md, "Engines"): SGLang's native `/generate`, `/health`,
`/server_info`, `/flush_cache`, and the OpenAI routes. So one replica class, one load generator and one record format
serve every engine. What differs per engine kind lives in its `Engine` subclass, chosen once from the config
(`serve.engines.engine_for`): the algorithms it implements, its command line, the Ray resources of its replica, the
checks that must pass on the replica's node before it starts, and how many replicas fit a cluster. No module outside
`serve/engines/` branches on the kind.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_serializer, model_validator

from serve.spec import FrozenModel, NgramSpec, NoSpec, SpecConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]
EngineKind = Literal["cpu", "sglang", "llama_cpp", "vllm"]
REDACTED = "<redacted>"
# A shipped corpus travels inside the replica's config (Serve's deployment arguments, the registered serving config,
# `/v1/config`): kept small enough for all of them. A larger corpus belongs on a filesystem every engine node sees.
MAX_SHIPPED_CORPUS_BYTES = 8 * 2**20
CORPUS_FOLDER = "corpora"


# `python -m serve.production` starts its local Ray with a fixed glibc mmap threshold (serve.production:
# local_ray_environment) and names the value it set here; the engines it starts get glibc's default back.
ENDPOINT_MALLOC_MARKER = "SPECDEC_ENDPOINT_MALLOC_MMAP_THRESHOLD"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for our own `python -m serve...` subprocesses: they must import this project even when the
    caller's working directory is elsewhere (Tune runs trials in their own folders) and it is not pip-installed.
    The endpoint's fixed mmap threshold is not passed on (an engine's large tensors would each cost an mmap)."""
    env = {**os.environ, **(extra or {})}
    # Their output goes to log files, where a progress bar redrawn in place is one unreadable line per redraw
    # (SGLang's weight loading, Hugging Face downloads); a caller's explicit setting is kept.
    env.setdefault("TQDM_DISABLE", "1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if ENDPOINT_MALLOC_MARKER in env and env.get("MALLOC_MMAP_THRESHOLD_") == env[ENDPOINT_MALLOC_MARKER]:
        del env["MALLOC_MMAP_THRESHOLD_"], env[ENDPOINT_MALLOC_MARKER]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def redact_env(env: dict[str, str], info: Any) -> dict[str, str]:
    """Serializer for `env` fields: values (tokens, passwords) leave a config only when the caller asks for them
    (`model_dump(context={"reveal_env": True})`, done solely to hand the config to the replica that starts the
    engine). Logged, printed and written forms carry the variable names only."""
    if (getattr(info, "context", None) or {}).get("reveal_env"):
        return dict(env)
    return {name: REDACTED for name in env}


def corpus_jsonl(documents: Sequence[str]) -> bytes:
    """Documents as an external-corpus JSONL body (SGLang's format: one JSON string per line). Pure."""
    return "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in documents).encode("utf-8")


def corpus_file_name(path: str) -> str:
    """The file name a shipped corpus gets on the engine's node: the name of `spec.external_corpus`. Pure."""
    return Path(path).name or "corpus.jsonl"


class ReplicaConfig(FrozenModel):
    """Everything one engine replica needs to start. Trials and the production endpoint both build one."""

    engine: EngineKind = "cpu"
    model: str = Field(description="cpu: model id, HF dir or .gguf; sglang: model path or HF id")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="cpu: float32|bfloat16; sglang: its --dtype (auto = SGLang's choice, float16 on CPU)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="sglang: where SGLang runs; auto = cuda where the cluster has GPUs, else cpu")
    attention_backend: str | None = Field(
        None, description="sglang --attention-backend, the same for baseline and trials (a study decides it at its "
        "start); None = the adapter's (cpu: torch_native; cuda: flashinfer for MHA, triton for MLA models)")
    spec: SpecConfig = Field(default_factory=NoSpec)
    max_running_requests: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads")
    cpus: tuple[int, ...] | None = Field(None, min_length=1, description="CPUs the engine process and its children "
                                         "may run on (Linux affinity); None = those of the replica that starts it")
    weights: Literal["auto", "fp32", "gguf"] = Field("auto", description="cpu engine --weights (serve/engines/cpu/"
                                                     "gguf_linear.py): decode matmuls on the GGUF blocks or fp32")
    tp_size: int = Field(1, ge=1, description="GPUs per replica (sglang)")
    replica_cpus: float | None = Field(None, ge=0, description="CPUs Ray reserves per replica; None = engine default")
    replica_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources per replica, e.g. {engine_node: 1} to pin replicas")
    extra_flags: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="engine process environment; values never logged")
    env_from: list[str] = Field(default_factory=list, description="names of variables the engine takes from the "
                                "replica's own environment (how a served config carries secrets: by reference)")
    start_timeout_s: float = Field(600.0, gt=0)
    log_dir: str | None = Field(None, description="where the engine log goes; None = a temp dir")
    corpus_documents: tuple[str, ...] | None = Field(
        None, description="the NGRAM external corpus itself, shipped with the replica: the replica writes it as "
        "JSONL on its own node (<log_dir>/corpora/<name of spec.external_corpus>) and points the engine there, so no "
        "filesystem need be shared; None = spec.external_corpus is a path the engine's node reads as it is")

    _redact = field_serializer("env")(redact_env)

    @model_validator(mode="after")
    def _shipped_corpus(self) -> ReplicaConfig:
        if self.corpus_documents is None:
            return self
        if not isinstance(self.spec, NgramSpec) or self.spec.external_corpus is None:
            raise ValueError("corpus_documents: given, but spec.external_corpus is not set (only an NGRAM spec with "
                             "a corpus loads one). Fix: set spec.external_corpus to the corpus's file name, or drop "
                             "corpus_documents")
        if not self.corpus_documents:
            raise ValueError("corpus_documents: empty (SGLang refuses an empty corpus). Fix: give at least one "
                             "document, or set spec.external_corpus to null")
        size = len(corpus_jsonl(self.corpus_documents))
        if size > MAX_SHIPPED_CORPUS_BYTES:
            raise ValueError(f"corpus_documents: {len(self.corpus_documents)} documents, {size} bytes as JSONL, "
                             f"more than the {MAX_SHIPPED_CORPUS_BYTES} bytes a replica config may carry. Fix: put "
                             "the corpus on a filesystem every engine node sees and give its path as "
                             "spec.external_corpus without corpus_documents (in a search space: 'shared:<path>')")
        return self

    def to_replica(self) -> dict[str, Any]:
        """The JSON form handed to the Serve replica (the only form that carries env values)."""
        return self.model_dump(mode="json", context={"reveal_env": True})


class ConfigRejected(RuntimeError):
    """The engine itself (e.g. SGLang's own parser) refused the configuration: the trial is INVALID, not a failure
    of the machine. Raised in the replica; the message starts with `MARKER` so it survives Serve's error text."""

    MARKER = "[engine rejected the config]"

    def __init__(self, reason: str) -> None:
        super().__init__(f"{self.MARKER} {reason}")
        self.reason = reason


class Engine:
    """One engine kind. Stateless; methods that run on the replica's node say so."""

    kind: ClassVar[str]
    algorithms: ClassVar[frozenset[str]]
    label: ClassVar[str]  # for messages: "the CPU engine", "SGLang"
    # Whether its OpenAI routes return a request's spec counters when asked (SGLang 0.5.23's
    # `return_spec_tokens_details` -> `sglext.spec_tokens_details`): the production ingress then asks, for live
    # accept length. llama-server takes the field and returns none.
    spec_details: ClassVar[bool] = False
    # How its HTTP API takes a batch of extends on cached contexts (the pipeline's verify-cost probe): "generate" =
    # SGLang's native `/generate` (token-id prompts in one call, prompt logprobs from a position on, `cached_tokens`);
    # "completion" = llama-server's `/completion` (several prompts in parallel slots, `cache_prompt`, no logits of
    # prompt positions).
    extend_api: ClassVar[str] = "generate"

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        """The engine's full command line."""
        raise NotImplementedError

    def command_argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        """The command line as a user runs it from the deploy folder (deploy/engine_command.sh): files the deploy
        writes beside it named by file name, nothing drawn for one launch. Default: `argv`."""
        return self.argv(config, host, port)

    def start_timeout_s(self, config: ReplicaConfig, cold: bool | None = None) -> float:
        """How long this node's start of `config` may take before it is a TIMEOUT. `cold` None: whether this node
        has started it before (`note_started`); True: the longest a start may take anywhere (a driver waiting on a
        replica elsewhere). Default: `config.start_timeout_s`, warm or cold."""
        return config.start_timeout_s

    def note_started(self, config: ReplicaConfig) -> None:
        """Runs on the node after `config`'s engine answered healthy: later starts there are warm."""

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        """`ray_actor_options` of the replica that owns the engine process."""
        raise NotImplementedError

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """How many replicas of this config can run at once on a cluster with these total resources."""
        raise NotImplementedError

    def build_ahead(self) -> list[str] | None:
        """A command that builds, on this machine, what the engine's first start here would otherwise build (a
        kernel): the driver runs it in the background while it fetches the model, so that the two overlap on a fresh
        machine. It must be safe beside an engine start building the same thing and quick when there is nothing left
        to build. None: nothing to build."""
        return None

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """Runs in the replica, on its node, before the engine starts: prerequisites and the engine's own verdict on
        `argv`. Returns what it found (recorded with the trial); raises ConfigRejected when the engine refuses the
        config, RuntimeError when this node cannot run it."""
        return {}

    def model_problem(self, model: str, where: str = "model.target") -> str | None:
        """Why `model` cannot start on this machine, known before anything starts (the study's up-front checks, when
        the engines run here); None when there is no objection or no way to tell (a hub id, a remote node's path).
        Default: a value written as a local path (absolute, `~`, `./`, `../`, or a `.gguf` file) must exist."""
        local = model.startswith(("/", "~", "./", "../")) or model.endswith(".gguf")
        path = Path(model).expanduser()
        if local and not path.exists():
            return f"{where}: {model!r} does not exist on this machine (resolved: {path.resolve()}); fix the path"
        return None

    def native_deploy_files(self, config: ReplicaConfig, host: str, port: int) -> dict[str, str]:
        """Deploy files (name -> text) beyond the engine command line, for an engine whose own server can run
        without our wrapper (llama.cpp: the bare `llama-server` command). Empty by default."""
        return {}

    def level_deploy_files(self, served: Mapping[int, ReplicaConfig], host: str, port: int) -> dict[str, str]:
        """Deploy files for a study of several concurrency levels, from the replica its policy serves at each
        measured level (vLLM: the bare command of the second engine, and the per-level decision as vLLM's own
        per-batch-size table). Empty by default."""
        return {}

    def start_env(self, config: ReplicaConfig) -> dict[str, str]:
        """The engine process's environment: `env`'s values plus each `env_from` name read from this process's own
        environment. A name that is not set there is an error, not an engine started without its secret."""
        missing = [name for name in config.env_from if name not in config.env and name not in os.environ]
        if missing:
            raise RuntimeError(f"env_from: variable(s) {missing} are not set in the replica's environment; set them "
                               "on every node that can run the engine (e.g. the Serve runtime_env or the pod spec)")
        return child_env({**{name: os.environ[name] for name in config.env_from if name not in config.env},
                          **config.env})

    def deterministic_flags(self, config: ReplicaConfig) -> list[str] | None:
        """Flags that start `config`'s engine in its deterministic-inference mode, where a request's greedy output
        does not depend on the batch it ran in (the `deterministic` equivalence mode checks outputs on such engines
        and measures throughput without them). [] = it is batch-invariant as it is; None = it has no such mode."""
        return None

    # Whether `draft_replay_argv` gives a command: the engine's STANDALONE drafting can be replayed on a baseline's
    # recorded tokens (pipeline.search.draft_replay), so simulate-first predicts its draft-model configs.
    replays_drafts: ClassVar[bool] = False
    # Whether the engine's own tokenizer can split a text otherwise than the model's HF tokenizer, which records the
    # prompt ids simulate-first replays: such an engine is sent those ids instead of the text in a simulate-first
    # study, so that it and the replay see the same tokens (pipeline.study.driver.workload_requests).
    retokenizes: ClassVar[bool] = False

    def draft_replay_argv(self, draft_model: str, dtype: str, weights: str, threads: int | None) -> list[str]:
        """The command that runs this engine's STANDALONE drafting (the draft model only) over recorded tokens on
        this machine; the caller appends `--input IN.json --output OUT.json` (serve.engines.cpu.draft_replay's
        format). Only where `replays_drafts`."""
        raise NotImplementedError(f"{self.label} cannot replay a draft model's trees: its STANDALONE configs are "
                                  "launched")

    @staticmethod
    def server_accept_length(server_info: dict[str, Any]) -> float | None:
        """The engine's own cumulative accept length, when it reports one. Optional by contract: SGLang adds
        `avg_spec_accept_length` only after a 40-decode-batch window and a flush resets it. Per-request
        `meta_info` counters are the trial's source of truth."""
        states = server_info.get("internal_states") or [{}]
        value = states[0].get("avg_spec_accept_length") if isinstance(states[0], dict) else None
        return float(value) if isinstance(value, (int, float)) else None

    # What a study asks of the kind before anything starts: the dry run, the up-front checks, the study's start and
    # the deploy folder (docs/design.md, "Add an engine"). Each default means "not applicable to this kind".
    # Whether it loads a Hugging Face hub id: an unknown model name is then no typo (its files are on the node).
    loads_hub_ids: ClassVar[bool] = False
    # What a model argument may be besides a bundled id, for the message that refuses one.
    model_forms: ClassVar[str] = "a path to a .gguf file or a local HF folder (with config.json)"
    # The bundled search space (search_spaces/<name>) the dry run names first for this kind.
    recommended_space: ClassVar[str] = "default.yaml"
    # Whether it takes `--context-length` and answers 400 to a prompt past the model's context
    # (pipeline.workloads.context checks the workload against it before a launch).
    context_limited: ClassVar[bool] = False
    # Its pace on a CPU for the dry run's estimate (pipeline.study.estimate; docs/benchmarks.md): the engine start in
    # seconds (None: the CPU engine's), the decode speed as a multiple of the CPU engine's, and the words naming them
    # ({size}: the model's scaling note).
    cpu_start_s: ClassVar[float | None] = None
    cpu_speed: ClassVar[float] = 1.0
    cpu_basis: ClassVar[str] = "the CPU engine on SmolLM2-135M{size}"

    def model_name(self, model: str) -> str:
        """The model store's name of a model argument (llama.cpp: without its `@f32` suffix)."""
        return model

    def device(self, config: ReplicaConfig) -> str:
        """Where `config`'s engine runs, as resolved here: "cpu" or "cuda"."""
        return "cpu"

    def describe_device(self, config: ReplicaConfig) -> str | None:
        """For the dry run: where `config` would run and why; None for a kind without a device choice."""
        return None

    def gpu_study(self, device: str, gpu_here: Callable[[], bool]) -> bool:
        """Whether a study with `engine.device` `device` runs on a GPU and so takes the GPU defaults
        (pipeline/config/engine_defaults.py); `gpu_here` asks this machine or its cluster, called only if needed."""
        return False

    def cpu_size_limited(self, config: ReplicaConfig) -> bool:
        """Whether `config` runs on this machine's CPU at a pace where a model of billions of parameters is no study
        (pipeline.preflight_engine.cpu_capacity_problem). The bundled table bounds the CPU engines' own models."""
        return False

    def installed(self, device: str) -> Path | None:
        """What this machine holds of the engine's install for `device` (a binary, an interpreter); None when there
        is nothing to find or it is missing. Reads the filesystem."""
        return None

    def install_problem(self, device: str, installed: Path | None) -> str | None:
        """Why the engine cannot start here for want of an install, given `installed(device)`, with the fix; None
        when it can or nothing is checked. Pure."""
        return None

    def pinned_settings(self, config: ReplicaConfig) -> dict[str, Any]:
        """What the command line fixes beyond the speculative table, by `/server_info` name, for
        `settings.effective_diff(..., pinned=...)`."""
        return {}

    def node_facts(self, config: ReplicaConfig) -> Any:
        """What the node this runs on says about itself for `config` (SGLang: its GPU architecture, the model's
        config.json); None where the kind needs nothing."""
        return None

    def shared_settings(self, config: ReplicaConfig, gpu_arch: str, widest: Any, probes: Any,
                        deterministic: bool) -> Any:
        """Engine settings one study's engines share, decided once before its first trial; None where the kind
        decides nothing."""
        return None

    def check_commands(self, configs: Sequence[ReplicaConfig], arch: str | None) -> list[Any] | None:
        """The engine's command lines for `configs`, each with the engine's own verdict; None without such a
        verdict."""
        return None

    def deploy_folder_report(self, folder: Path) -> str | None:
        """The engine's own check of the files a deploy folder holds for it; None when there is nothing to say."""
        return None


def python_module_argv(module: str) -> list[str]:
    """`python -m module` with this interpreter (never a name looked up on PATH)."""
    return [sys.executable, "-m", module]
