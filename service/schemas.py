"""Request and response bodies of the API. The request model is built from the settings so that the
limits in force are the ones validated and the ones the OpenAPI schema at ``/docs`` shows."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    field_validator,
)
from pydantic_core import PydanticCustomError

from coreply.filters import CONDITIONS, NESTED, VALUES
from coreply.ranking import Fusion
from service.settings import Settings


class RespondBase(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN or 1e999: 422, not an empty answer

    @field_validator("context", "knowledge", check_fields=False)
    @classmethod
    def _no_blank_utterances(cls, texts: list[str] | None) -> list[str] | None:
        for i, text in enumerate(texts or ()):
            if not text.strip():
                raise ValueError(f"item {i} is blank")
        return texts


def respond_request_model(settings: Settings) -> type[RespondBase]:
    most = settings.max_utterance_chars
    utterance = Annotated[StrictStr, Field(min_length=1, max_length=most)]

    def id_or_text(value: Any, handler: ValidatorFunctionWrapHandler) -> int | str:
        try:
            return handler(value)
        except ValidationError:  # one message for the item, not one per member of the union
            raise PydanticCustomError(
                "id_or_text",
                "Input should be a response id (an integer, 0 or more) or a text of at most "
                f"{most} characters",
            ) from None

    excluded = Annotated[
        Annotated[StrictInt, Field(ge=0)] | Annotated[StrictStr, Field(max_length=most)],
        WrapValidator(id_or_text),
    ]
    return create_model(
        "RespondRequest",
        __base__=RespondBase,
        context=(
            list[utterance],
            Field(
                min_length=1,
                max_length=settings.max_turns,
                description="the dialogue so far, oldest utterance first",
                examples=[["hi! how was your weekend?", "great, i went hiking. you?"]],
            ),
        ),
        top_k=(StrictInt, Field(1, ge=1, le=settings.max_top_k, description="responses to return")),
        n_candidates=(
            StrictInt | None,
            Field(
                None,
                ge=1,
                le=settings.max_candidates,
                description=f"n_r: candidates recalled and reranked (default {settings.default_candidates}, "
                "at least top_k)",
            ),
        ),
        fusion=(
            Fusion | None,
            Field(
                None,
                description="final score: retrieval only (the first stage: dense, fused with BM25 where the "
                "bundle has a lexical stage), rerank only, their sum, or z-score fusion with the bundle's "
                "calibrated weight; default: with a reranker the one the bundle was calibrated with (sum or "
                "zscore) of the candidates within the bundle's rerank reach where the first stage does not "
                "lead past its rerank gate, else retrieval",
            ),
        ),
        min_retrieval_score=(
            float | None,
            Field(
                settings.min_retrieval_score,
                description="responses whose retrieval score is below this are not returned; if none is "
                "left, the answer carries the service's fallback text (default: COREPLY_MIN_RETRIEVAL_SCORE)",
            ),
        ),
        knowledge=(
            list[utterance] | None,
            Field(
                None,
                max_length=settings.max_knowledge,
                description="background sentences the reply may draw on (a persona, an operator's facts), "
                "for a bundle whose reranker reads knowledge; its knowledge retriever picks the few read. "
                "Default: the bundle's own knowledge, if it has any",
                examples=[["i have two dogs and a cat.", "i work as a nurse on night shifts."]],
            ),
        ),
        allow_restatements=(
            StrictBool,
            Field(
                False,
                description="also answer with responses that restate a turn of the context; by default a "
                "bundle with a restatement guard drops them (GET /readyz shows its threshold)",
            ),
        ),
        allow_variants=(
            StrictBool,
            Field(
                False,
                description='also answer with spelling variants of a better answer ("heyy" after "Hey!": '
                "the same letters and digits but for case, punctuation, spacing and held letters); by "
                "default each is passed over and the next candidate takes its place",
            ),
        ),
        exclude=(
            list[excluded],
            Field(
                default_factory=list,
                max_length=settings.max_exclude,
                description="response ids or texts not to return (e.g. already said in this conversation)",
            ),
        ),
        filter=(
            dict[str, Any] | None,
            Field(
                None,
                description="answer only with responses whose metadata (the pool file's other fields) "
                "meets every field's condition: equal to a value, to one of a list of values, or meeting "
                "every operator of an object ($eq, $ne, $in, $nin, $gt, $gte, $lt, $lte on numbers, "
                "$exists: true or false; $ne and $nin also allow responses without the field); a field "
                "that is a list in the pool file matches when one of its items does. Filters combine with "
                f"$and and $or (a list of filters) and $not (one filter), {NESTED} deep. A field no "
                "response has, or an operator that cannot match as meant, is a 422 naming it. At most "
                f"{CONDITIONS} conditions in all and {VALUES} values a list. The search runs within the "
                "responses allowed; with an API key scoped by a filter of its own, within those both allow",
                examples=[{"locale": "en", "intent": ["refund", "billing"], "price": {"$lt": 20}}],
            ),
        ),
    )


class Candidate(BaseModel):
    id: int = Field(description="the response's row in the bundle (usable in `exclude`)")
    text: str
    score: float = Field(description="under the fusion used")
    retrieval_score: float = Field(description="the dense retriever's (what min_retrieval_score reads)")
    rerank_score: float | None = None
    lexical_score: float | None = Field(
        None, description="BM25 against the context's words, with a bundle's lexical stage (GET /readyz)"
    )
    metadata: dict[str, Any] | None = Field(
        None, description="the pool file's other fields for this response (your id, intent, template...)"
    )


class Degraded(BaseModel):
    """Present when the load-adaptive cascade gave this request less work than it asked for."""

    level: int = Field(description="1-3; each level halves n_r, level 3 may skip the reranker")
    requested_candidates: int
    requested_fusion: Fusion


class RespondResponse(BaseModel):
    responses: list[Candidate]
    fusion: Fusion = Field(
        description="the fusion used (retrieval when the cascade or the rerank gate skipped reranking)"
    )
    rerank_gated: bool = Field(
        False,
        description="the first stage led by more than the bundle's rerank gate (GET /readyz), so this "
        "request, which named no fusion, was answered without the reranker (COREPLY_RERANK_GATE)",
    )
    reranked: int = Field(
        0,
        description="candidates the reranker read: every one for a named fusion; for a request that named "
        "none, those before the first that trails the first stage's best by the bundle's rerank reach "
        "(GET /readyz), at least top_k; 0 where it did not run",
    )
    n_candidates: int
    bundle_version: str
    timings_ms: dict[str, float] = Field(
        description="total, queue_wait, encode, search, filter (dropping echoes, exclusions and "
        "restatements), lexical (BM25 reordering the candidates), knowledge (picking the knowledge the "
        "reranker reads), rerank (milliseconds; batch stages are shared)"
    )
    degraded: Degraded | None = None
    fallback: str | None = Field(
        None,
        description="set (to the service's fallback text) when the answer has no response: none reached "
        "min_retrieval_score, or the filter allowed none",
    )


class ErrorResponse(BaseModel):
    error: str
    detail: list[dict] | None = None
