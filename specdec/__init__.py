"""specdec: lossless speculative decoding for Hugging Face transformers causal LMs."""

from .cache_pool import cache_pool_limit, pooled_bytes, release_caches, set_cache_pool_limit
from .decoder import SpecDecoder, SpecOutput
from .generators import CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, NoDraft, Proposal
from .grammar import Grammar
from .integration import generate
from .metrics import AcceptanceStats, theoretical_speedup
from .models import load_model
from .registry import available_generators, get_candidate_generator, register_candidate_generator
from .sampling import SamplingParams

__all__ = [
    "AcceptanceStats", "CandidateGenerator", "DecodeContext", "DraftLengthSchedule", "Feedback", "Grammar", "NoDraft",
    "Proposal", "SamplingParams", "SpecDecoder", "SpecOutput", "available_generators", "cache_pool_limit",
    "generate", "get_candidate_generator", "load_model", "pooled_bytes", "register_candidate_generator", "release_caches",
    "set_cache_pool_limit", "theoretical_speedup",
]
__version__ = "0.1.0"
