"""hf_radix: SGLang-style radix prefix caching for Hugging Face transformers.

Importing the package registers the "radix" attention and `cache_implementation="radix"`.
"""

from transformers.utils import logging as _logging

from .attention import register as _register_attention
from .cache_utils import RadixCache
from .engine import RadixEngine, configure, get_engine
from .errors import RequestError, TrainingModeError, UnsupportedModelError
from .integrations.data_parallel import DataParallelRunner
from .integrations.evaluation import score_choices
from .integrations.generate_hook import register_generate_support
from .memory import cache_io as _cache_io
from .memory.cache_io import CacheFileError
from .memory.radix_tree import IntegrityError
from .options import EngineOptions
from .runner import RadixBatchRunner
from .scheduling.request import RequestOutput
from .scheduling.sampling import SamplingParams
from .stats import RadixStats

__all__ = [
    "CacheFileError",
    "DataParallelRunner",
    "EngineOptions",
    "IntegrityError",
    "RadixBatchRunner",
    "RadixCache",
    "RadixEngine",
    "RequestError",
    "RequestOutput",
    "RadixStats",
    "SamplingParams",
    "TrainingModeError",
    "UnsupportedModelError",
    "cache_stats",
    "configure",
    "get_engine",
    "load_cache",
    "reset_cache",
    "save_cache",
    "score_choices",
]
__version__ = "0.1.0"


def cache_stats(model) -> dict:
    """Prefix-reuse statistics of the model's engine: prompt/cached/computed tokens, hit rate, evictions."""
    return get_engine(model).stats_dict()


def reset_cache(model) -> None:
    """Drops every cached prefix of the model: after a change hf_radix cannot see (writes through `.data`)."""
    get_engine(model).reset_cache()


def save_cache(model, path) -> dict:
    """Saves the model's prefix cache to a safetensors file; see `RadixBatchRunner.save_cache`."""
    return _cache_io.save_cache(get_engine(model), path)


def load_cache(model, path) -> dict:
    """Loads a saved prefix cache into the model's engine; refuses another model, dtype or layout."""
    return _cache_io.load_cache(get_engine(model), path)


# transformers' get_logger leaves other packages outside its root logger: hanging "hf_radix" under it
# makes transformers.logging.set_verbosity_* (and TRANSFORMERS_VERBOSITY) control hf_radix's messages.
_logging.get_logger(__name__).parent = _logging.get_logger()
_register_attention()
register_generate_support()
