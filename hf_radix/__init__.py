"""hf_radix: SGLang-style radix prefix caching for Hugging Face transformers.

Importing the package registers the "radix" attention and `cache_implementation="radix"`.
"""

from .attention import register as _register_attention
from .cache_utils import RadixCache
from .engine import RadixEngine, configure, get_engine
from .generate_hook import register_generate_support
from .radix_tree import IntegrityError
from .request import RequestOutput
from .runner import RadixBatchRunner
from .sampling import SamplingParams
from .stats import RadixStats

__all__ = [
    "IntegrityError",
    "RadixBatchRunner",
    "RadixCache",
    "RadixEngine",
    "RequestOutput",
    "RadixStats",
    "SamplingParams",
    "cache_stats",
    "configure",
    "get_engine",
]
__version__ = "0.1.0"


def cache_stats(model) -> dict:
    """Prefix-reuse statistics of the model's engine: prompt/cached/computed tokens, hit rate, evictions."""
    return get_engine(model).stats_dict()


_register_attention()
register_generate_support()
