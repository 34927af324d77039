"""One statistics schema for an engine (`hf_radix.cache_stats(model)`) and a runner (`runner.stats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RadixStats:
    """Prefix-reuse and throughput counters; an engine's sum every path that used it, a runner's its calls."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    host_cached_tokens: int = 0  # of cached_tokens, copied back from the host tier
    computed_tokens: int = 0
    generated_tokens: int = 0
    forward_calls: int = 0
    invalidations: int = 0  # times the cache was dropped because the model's weights or config changed
    invalidated_tokens: int = 0  # cached tokens those drops released
    wall_time: float = 0.0  # seconds inside radix calls (an engine: runner calls and radix generate calls)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_cached_tokens(self) -> int:
        """Of cached_tokens, those found on the GPU (the rest came back from the host tier)."""
        return self.cached_tokens - self.host_cached_tokens

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_time if self.wall_time else 0.0

    def as_dict(self) -> dict:
        return {
            **asdict(self), "gpu_cached_tokens": self.gpu_cached_tokens, "hit_rate": self.hit_rate,
            "tokens_per_s": self.tokens_per_s,
        }

    def __repr__(self) -> str:
        return (
            f"RadixStats(requests={self.requests}, prompt_tokens={self.prompt_tokens}, "
            f"cached_tokens={self.cached_tokens}, host_cached_tokens={self.host_cached_tokens}, "
            f"hit_rate={self.hit_rate:.3f}, "
            f"computed_tokens={self.computed_tokens}, generated_tokens={self.generated_tokens}, "
            f"forward_calls={self.forward_calls}, invalidations={self.invalidations}, "
            f"wall_time={self.wall_time:.2f}s, "
            f"tokens_per_s={self.tokens_per_s:.1f})"
        )
