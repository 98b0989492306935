"""SamplingParams: how one request is decoded (vLLM's names and meanings).

Logit rules, in vLLM's order and with its definitions (sampler.py applies them, sampling_rules.py keeps
the per-sequence token counts they need): min_tokens sets the stop ids (EOS unless ignore_eos, and
stop_token_ids) to -inf until that many tokens were generated; repetition_penalty r divides positive and
multiplies negative logits of every token in the prompt or the output by r; frequency_penalty f and
presence_penalty p subtract f * count and p * [count > 0] of each generated token; then temperature;
min_p drops tokens with p < min_p * p_max; then top-k and top-p.
Log-prob of a sampled token (CompletionOutput.token_logprobs), chosen per request by `logprobs_mode`:
  "raw"       log_softmax(logits / temperature) of the model's logits over the FULL vocabulary, before
              every rule above. Unlike vLLM's "raw_logprobs" (taken before temperature) ours includes it.
  "processed" log-prob under the distribution actually sampled from: log_softmax of the logits after
              every rule (vLLM's "processed_logprobs"). Unbiased importance ratios for RL when a filter
              is on; the learner recomputes it with sampler.sequence_logprobs, which knows temperature,
              top-k and top-p only: the RL config (GenSection) offers no penalties, min_p or min_tokens.
Without any rule the two are identical; for greedy decoding (temperature 0) both are log_softmax(logits)
(processed: of the penalised logits).
vLLM's `logprobs=k` gives, per generated token, the k most likely tokens plus the sampled one as
{token_id: Logprob(logprob, rank, decoded_token)} (CompletionOutput.logprobs), under the same distribution
as token_logprobs; `prompt_logprobs=k` the same per prompt token (the first None), under
log_softmax(logits / temperature).
Seeds: sample i of a request with seed s draws with the seed sample_seed(s, i): s itself for
i = 0, a splitmix64 mix of (s, i) for i >= 1 (never s + i, which would make sample 1 of seed s
sample 0 of seed s + 1). So a request with n = G and seed s produces exactly what G requests
with n = 1 and seeds sample_seed(s, 0), ..., sample_seed(s, G - 1) produce, whatever else is
in the batch (a seeded draw depends only on its seed, its position and its logits).
Text (engine/detokenizer.py): `detokenize` None (the default) makes text for requests that came as text
(a str / {"prompt": ...} prompt, LLM.chat) or that have stop strings, and none for token-id prompts
(the trainer's: no per-step cost); True / False force it on / off. Stop strings follow vLLM: the
sample finishes with finish_reason "stop" and stop_reason = the matched string, its text is cut
there (keeping the string with include_stop_str_in_output), its token_ids keep the token that
completed the match. Stop strings, like stop tokens, count only once min_tokens tokens exist (vLLM).
best_of (vLLM: draw best_of samples, return the n of highest cumulative log-prob) is accepted only as
None or n: returning the best n of more samples biases the log-probs an RL learner sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LOGPROBS_MODES = ("raw", "processed")
_MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """The splitmix64 finaliser of a 64-bit value (Steele, Lea, Flood 2014): a bijection that
    scatters nearby inputs across all 64 bits. Pure Python, identical in every process."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, index: int) -> int:
    """The seed sample `index` of a request with `seed` draws with (a 64-bit int).

    index 0 keeps the request's seed, so a one-sample request with seed t draws exactly what
    sample 0 of any request with seed t draws; index i >= 1 mixes (seed, i) through splitmix64,
    so the samples of one request, and of requests with nearby seeds, do not share draws.
    """
    if index < 0:
        raise ValueError(f"sample_seed: index must be >= 0, got {index}")
    seed &= _MASK64
    if index == 0:
        return seed
    return splitmix64(seed ^ splitmix64(index))


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """Decoding parameters of one request; validated on construction."""

    n: int = 1                                  # samples (a GRPO group); the prompt is prefilled once
    temperature: float = 1.0                    # 0 = greedy
    top_k: int = -1                             # -1 (or 0) = whole vocabulary
    top_p: float = 1.0                          # nucleus mass in (0, 1]
    max_tokens: int = 16                        # generated tokens at most
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False                    # keep going past the model's EOS ids
    seed: int | None = None                     # per-request seed (sample i: sample_seed(seed, i))
    logprobs_mode: str = "raw"                  # "raw" | "processed": see the module docstring
    logprobs: int | None = None                 # k >= 0: per token the k most likely (+ the sampled) as Logprob
    prompt_logprobs: int | None = None          # k >= 0: the same per prompt token (the first is None)
    min_p: float = 0.0                          # drop tokens with p < min_p * p_max, in [0, 1]
    min_tokens: int = 0                         # no stop token / stop string before this many tokens
    presence_penalty: float = 0.0               # subtracted once from each generated token's logit, in [-2, 2]
    frequency_penalty: float = 0.0              # subtracted per occurrence of a generated token, in [-2, 2]
    repetition_penalty: float = 1.0             # > 0; prompt and output tokens: logit / r if > 0 else logit * r
    best_of: int | None = None                  # None or n (see the module docstring)
    stop: list[str] | str | None = None         # stop strings (a str is one); normalised to a list
    include_stop_str_in_output: bool = False    # keep the matched stop string in the text
    skip_special_tokens: bool = True            # leave special tokens out of the text
    detokenize: bool | None = None              # None: text for text prompts / stop strings; True / False: force

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"SamplingParams.{name} must be None or an int >= 0, got {v!r}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {self.stop!r}")
        if self.stop and self.detokenize is False:
            raise ValueError("SamplingParams.stop: stop strings need the text; drop detokenize=False")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"SamplingParams.top_k must be -1/0 (off) or >= 1, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplingParams.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        self._check_rules()

    def _check_rules(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"SamplingParams.best_of={self.best_of!r} (n={self.n}) is not supported: rlengine "
                             "returns every sample it draws (choosing the best n of more would bias the log-probs "
                             "a learner trains on); use n=best_of and rank by CompletionOutput.cumulative_logprob")

    @property
    def penalized(self) -> bool:
        """True when a penalty needs the sequence's token counts."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_rules(self) -> bool:
        """True when a rule beyond temperature / top-k / top-p is on (sampling_rules.py applies it)."""
        return self.penalized or self.min_tokens > 0 or (self.min_p > 0.0 and not self.greedy)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p is on (the sampled distribution is not the full softmax)."""
        return self.top_k > 0 or self.top_p < 1.0
