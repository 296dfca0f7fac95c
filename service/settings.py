"""Service settings: environment variables ``COREPLY_*`` (or ``coreply serve`` flags, which win)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.cors import Origins, parse_origins
from service.keys import KeyRing, env_keys, read_key_file
from service.tls import Certificate

DEFAULT_BUNDLE = Path("artifacts/default-bundle")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COREPLY_", extra="ignore", allow_inf_nan=False)
    _keys: KeyRing = PrivateAttr(default_factory=lambda: KeyRing(()))

    bundle: Path = Field(DEFAULT_BUNDLE, description="bundle directory (`coreply index build`)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    backend: Literal["auto", "onnx", "torch", "torch-bf16"] = Field(
        "auto",
        description="auto: ONNX if exported, else PyTorch; torch-bf16: PyTorch with bf16 weights (on a "
        "CPU with AMX faster than int8 ONNX at large n_r and closer to fp32; docs/performance.md 10)",
    )
    device: str = Field("cpu", description="auto (CUDA if the host has it), cpu, cuda or cuda:N")
    packed: bool = Field(
        True,
        description="on CUDA, the PyTorch backend runs batches without their padding where PyTorch has "
        "variable-length attention (docs/results.md 50); off: padded batches, as before",
    )
    threads: int = Field(
        0, ge=0, le=256, description="intra-op threads; 0 = measure 1 vs all cores, keep the faster"
    )

    # request limits (422 beyond them; 413 for the body)
    max_body_bytes: int = Field(64 * 1024, ge=1024)
    max_turns: int = Field(50, ge=1)
    max_utterance_chars: int = Field(2000, ge=1)
    max_top_k: int = Field(50, ge=1)
    max_candidates: int = Field(100, ge=1)
    default_candidates: int = Field(10, ge=1)
    max_exclude: int = Field(200, ge=0)
    max_knowledge: int = Field(100, ge=0, description="knowledge sentences one request may bring")

    # micro-batching of inference work across concurrent requests
    batch_max_pairs: int = Field(128, ge=1, description="most rerank pairs in one batch")
    batch_max_contexts: int = Field(32, ge=1, description="most contexts encoded in one batch")
    batch_wait_ms: float = Field(
        0.0, ge=0, le=100, description="longest wait for more work (0: batch what queued up meanwhile)"
    )
    queue_max: int = Field(256, ge=1, description="requests waiting per stage before 503")
    overlap_stages: bool = Field(
        True,
        description="retrieval and reranking on a thread each, so one batch is encoded and searched while "
        "another is reranked (off: one inference thread for both; docs/performance.md §7). Off by itself "
        "where both stages run PyTorch on the CPU and two OpenMP teams would exceed the cores (§11)",
    )
    request_timeout_ms: int = Field(
        0, ge=0, le=600_000, description="deadline per request unless X-Request-Timeout-Ms says; 0 = none"
    )
    drain_seconds: int = Field(
        20, ge=1, le=600, description="on SIGTERM, longest wait for in-flight requests to finish"
    )

    rerank_gate: bool = Field(
        True,
        description="a request that names no fusion skips the reranker where the first stage leads past the "
        "bundle's calibrated rerank gate, and elsewhere reranks only the candidates within its calibrated "
        "rerank reach of the first (GET /readyz); false: every such request reranks every candidate",
    )
    # load-adaptive cascade (service/cascade.py): shrink n_r, then skip the reranker, while requests queue
    cascade: bool = Field(True, description="degrade under sustained queueing (reported per response)")
    cascade_high_ms: float = Field(100.0, ge=0, description="mean queue wait that steps the level up")
    cascade_low_ms: float = Field(20.0, ge=0, description="mean queue wait that steps the level down")
    cascade_floor_candidates: int = Field(5, ge=1, description="n_r never shrinks below this")
    cascade_skip_rerank: bool = Field(True, description="the top level answers by retrieval alone")
    cascade_step_s: float = Field(1.0, ge=0, description="least time between two level changes")

    # when no response is similar enough (retrieval score: cosine for the built-in default), answer with a
    # fixed text instead; a request's `min_retrieval_score` overrides the threshold
    min_retrieval_score: float | None = Field(
        None, description="responses below this retrieval score are not returned; none: no threshold"
    )
    fallback_text: str = Field(
        "Sorry, I don't have a good answer to that.",
        description="the answer's `fallback` when it has no response (none reaches the minimum retrieval "
        "score, or a filter allows none)",
    )

    log_text: bool = Field(False, description="put dialogue text and answers in the access log")

    # optional API keys: requests to non-public routes need one (`Authorization: Bearer <key>` or
    # `X-API-Key: <key>`); several keys allow rotation
    api_keys: str = Field("", repr=False, description="comma-separated API keys; empty = no auth")
    api_keys_file: Path | None = Field(
        None,
        description="a JSON file of named API keys, each optionally scoped by a filter that every answer "
        "to its requests meets (service/keys.py); with COREPLY_API_KEYS, both sets are accepted",
    )
    public_routes: str = Field(
        "/healthz,/readyz,/metrics", description="comma-separated routes that never need a key"
    )

    tls_cert_file: Path | None = Field(
        None,
        description="a PEM certificate chain: serve HTTPS (TLS 1.2 or later) with it, read again on SIGHUP "
        "(service/tls.py); none: plain HTTP",
    )
    tls_key_file: Path | None = Field(
        None, description="the certificate's PEM private key, unless the certificate file holds it"
    )
    cors_origins: str = Field(
        "",
        description="comma-separated origins whose web pages may call the API and read its answers "
        "(https://chat.example.com, https://*.example.com for any subdomain, * for any page); empty: none "
        "(service/cors.py)",
    )

    @property
    def keys(self) -> KeyRing:
        """Every key accepted at start: ``api_keys`` (named ``default``) and ``api_keys_file``'s. The
        service re-reads them on SIGHUP (``ServiceState.keys`` holds the live ones)."""
        return self._keys

    @property
    def public(self) -> frozenset[str]:
        return frozenset(r.strip() for r in self.public_routes.split(",") if r.strip())

    @property
    def cors(self) -> Origins:
        return parse_origins(self.cors_origins)

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        from coreply.device import check_device_name

        return check_device_name(value)  # whether this host has it is checked at start

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        parse_origins(value)  # a ValueError names the entry no browser could send
        return value

    @field_validator("tls_cert_file", "tls_key_file", mode="before")
    @classmethod
    def _unset_when_empty(cls, value: object) -> object:
        return None if value == "" else value  # set but empty, as a ConfigMap often leaves it: no file

    @field_validator("api_keys_file", mode="before")
    @classmethod
    def _key_file(cls, value: object) -> object:
        if value == "":  # set but empty, as an environment or a ConfigMap often leaves it: no file
            return None
        if value is not None:
            read_key_file(Path(str(value)))  # said against its own setting; read again once all are known
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.cascade_low_ms > self.cascade_high_ms:
            low, high = self.cascade_low_ms, self.cascade_high_ms
            raise ValueError(f"COREPLY_CASCADE_LOW_MS ({low}) exceeds COREPLY_CASCADE_HIGH_MS ({high})")
        if self.default_candidates > self.max_candidates:
            n, most = self.default_candidates, self.max_candidates
            raise ValueError(f"COREPLY_DEFAULT_CANDIDATES ({n}) exceeds COREPLY_MAX_CANDIDATES ({most})")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("COREPLY_TLS_KEY_FILE is set without COREPLY_TLS_CERT_FILE, its certificate")
        if self.tls_cert_file is not None:
            try:  # said at start, not at the first handshake: read as the server will read them
                Certificate(self.tls_cert_file, self.tls_key_file)
            except ValueError as exc:
                raise ValueError(f"--tls-cert-file / --tls-key-file: {exc}") from None
        self._keys = self.read_keys()
        return self

    def read_keys(self) -> KeyRing:
        """``api_keys`` and ``api_keys_file`` read now, as at start and on each SIGHUP (service/state.py);
        a ValueError says what is wrong with them in one line."""
        keys = env_keys(self.api_keys)
        named = [] if self.api_keys_file is None else read_key_file(self.api_keys_file)
        if shared := {k.digest for k in keys} & {k.digest for k in named}:
            name = next(k.name for k in named if k.digest in shared)
            raise ValueError(f"{self.api_keys_file}: {name!r} holds a key COREPLY_API_KEYS also holds")
        ring = KeyRing(keys + named)
        if ring.scoped and "/respond" in self.public:
            raise ValueError(
                "COREPLY_PUBLIC_ROUTES opens /respond to everyone, so the filters of COREPLY_API_KEYS_FILE "
                "would scope nothing; take /respond out"
            )
        return ring
