"""hf_radix: SGLang-style radix prefix caching for Hugging Face transformers.

Importing the package registers the "radix" attention and `cache_implementation="radix"`.
"""

from transformers.utils import logging as _logging

from .attention import register as _register_attention
from .cache_utils import RadixCache, register_generate_support
from .data_parallel import DataParallelRunner
from .engine import RadixEngine, configure, get_engine
from .radix_tree import IntegrityError
from .request import RequestOutput
from .sampling import SamplingParams
from .scheduler import RadixBatchRunner, RunnerStats

__all__ = [
    "DataParallelRunner",
    "IntegrityError",
    "RadixBatchRunner",
    "RadixCache",
    "RadixEngine",
    "RequestOutput",
    "RunnerStats",
    "SamplingParams",
    "cache_stats",
    "configure",
    "get_engine",
]
__version__ = "0.1.0"


def cache_stats(model) -> dict:
    """Prefix-reuse statistics of the model's engine: prompt/cached/computed tokens, hit rate, evictions."""
    return get_engine(model).stats_dict()


# transformers' get_logger leaves other packages outside its root logger: hanging "hf_radix" under it
# makes transformers.logging.set_verbosity_* (and TRANSFORMERS_VERBOSITY) control hf_radix's messages.
_logging.get_logger(__name__).parent = _logging.get_logger()
_register_attention()
register_generate_support()
