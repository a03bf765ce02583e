"""adaptive-export runtime: numpy + the backend's own bindings; never torch or transformers.

from adaptive_export.runtimes import Generator, SamplingParams
gen = Generator("bundles/smollm2")
print(gen.generate("Name three rivers.", max_new_tokens=32).text)
"""

from adaptive_export.runtimes.bundle import Bundle, load_bundle
from adaptive_export.runtimes.errors import UsageError
from adaptive_export.runtimes.generate import GenerationResult, GenerationStats, Generator
from adaptive_export.runtimes.sampling import SamplingParams
from adaptive_export.runtimes.settings import DecodingSettings

__all__ = [
    "Bundle",
    "DecodingSettings",
    "GenerationResult",
    "GenerationStats",
    "Generator",
    "SamplingParams",
    "UsageError",
    "load_bundle",
]
