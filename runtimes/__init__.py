"""adaptive-export runtime: numpy + the backend's own bindings; never torch or transformers.

    from runtimes import Generator, SamplingParams
    gen = Generator("bundles/smollm2")
    print(gen.generate("Name three rivers.", max_new_tokens=32).text)
"""
from runtimes.bundle import Bundle, load_bundle
from runtimes.errors import UsageError
from runtimes.generate import GenerationResult, GenerationStats, Generator
from runtimes.sampling import SamplingParams

__all__ = ["Bundle", "GenerationResult", "GenerationStats", "Generator", "SamplingParams", "UsageError", "load_bundle"]
