import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fixtures import Shape, tokenizer_fields, write_random_llama  # noqa: E402

from aner.embedded import ensure_default_model  # noqa: E402

DATA = Path(__file__).parent / "data"
EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct, F16 GGUF (set up by `make model`)."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def tok_fields(request):
    """SmolLM2's tokenizer metadata. ANER_TOKENIZER_GGUF names a metadata-only copy instead, for
    machines without the cached model (the GPU machine gets one carried with the run)."""
    carried = os.environ.get("ANER_TOKENIZER_GGUF")
    return tokenizer_fields(carried if carried else request.getfixturevalue("smollm2"))


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory, tok_fields):
    """tiny(shape=Shape(), dtype='f32', seed=0) -> path of a random Llama GGUF (cached per args)."""
    cache = {}

    def make(shape=Shape(), dtype="f32", seed=0):
        key = (shape, dtype, seed)
        if key not in cache:
            d = tmp_path_factory.mktemp("tiny")
            cache[key] = write_random_llama(d / f"tiny-{dtype}.gguf", shape, tok_fields, dtype, seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny(tiny_factory):
    return tiny_factory()


@pytest.fixture(scope="session")
def smollm2_f32(smollm2, tmp_path_factory):
    from aner import gen
    dst = tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf"
    gen.dequantize_model(smollm2, dst, dtype="f32")
    return dst


@pytest.fixture(scope="module")
def base(tiny):
    """The tiny model imported (a test module may define its own `base`)."""
    from aner import gen
    return gen.import_model(tiny)


@pytest.fixture(scope="module")
def data(base):
    """The demo's training and validation rows prepared for `base`, context 64."""
    from aner import gen
    return tuple(gen.supervised_csv(base, EXAMPLES / "data" / f"{role}.csv", input="question", target="answer",
                                    role=role, context=64) for role in ("training", "validation"))
