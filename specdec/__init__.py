"""specdec: lossless speculative decoding for Hugging Face transformers causal LMs."""

from .decoder import SpecDecoder, SpecOutput
from .generators import CandidateGenerator, DecodeContext, DraftLengthSchedule, Feedback, NoDraft, Proposal
from .metrics import AcceptanceStats, theoretical_speedup
from .models import load_model
from .registry import available_generators, get_candidate_generator, register_candidate_generator
from .sampling import SamplingParams

__all__ = [
    "AcceptanceStats", "CandidateGenerator", "DecodeContext", "DraftLengthSchedule", "Feedback", "NoDraft",
    "Proposal", "SamplingParams", "SpecDecoder", "SpecOutput", "available_generators", "get_candidate_generator",
    "load_model", "register_candidate_generator", "theoretical_speedup",
]
__version__ = "0.1.0"
