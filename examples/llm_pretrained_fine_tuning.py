"""The seed's complete adaptation example, line for line, on the embedded SmolLM2-135M-Instruct.

Import the floating GGUF, prepare independently chosen training and validation rows with the
model's own tokenizer and chat template, train a LoRA adapter, checkpoint, reload, resume, then
publish a merged F32 GGUF, a q4_0 GGUF and an adapter, and ask llama.cpp the held-out questions
before and after. Every artifact goes into a fresh folder under out/; nothing is overwritten.

    make demo            # or: .venv/bin/python examples/llm_pretrained_fine_tuning.py [OUT_DIR]
"""
import sys
import time
from pathlib import Path

from aner import gen, llm
from aner.embedded import ensure_default_model

HERE = Path(__file__).parent
TARGETS = ["attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
HELD_OUT = ["Name the capital of Tolvara.", "Who is the founder of Tolvara?", "What is Tolvara's currency?"]


def ask(model, title):
    print(f"\n{title}")
    for q in HELD_OUT:
        print(f"  Q: {q}\n  A: {model.chat([{'role': 'user', 'content': q}], max_tokens=32).text().strip()}")


def main(out: Path):
    out.mkdir(parents=True)
    source = ensure_default_model()
    started = time.perf_counter()

    base = gen.import_model(source, device="cpu", max_memory_bytes=4294967296)
    training = gen.supervised_csv(base, HERE / "data" / "training.csv", input="question",
                                  target="answer", role="training", context=128)
    validation = gen.supervised_csv(base, HERE / "data" / "validation.csv", input="question",
                                    target="answer", role="validation", context=128)
    print(base.summary())
    print(training.summary())
    print(validation.summary())

    with llm.load(source, context=128, device="cpu") as native:
        ask(native, "Before training (llama.cpp, base model):")

    # LoRA on every projection of every layer; the seed's default would be base.lora() (q and v).
    adapted = base.lora(TARGETS, rank=16, alpha=32.0, seed=71)
    print(f"\n{adapted.summary()}\n{adapted.memory_summary()}\n")
    print(f"validation loss before training: {adapted.evaluate(validation):.4f}")
    tuned = adapted.fine_tune(training, validation, steps=20, micro_batch=1, accumulation=4,
                              rate=0.001, seed=71)
    print(f"validation loss after 20 updates: {tuned.validation_loss():.4f}")
    tuned.checkpoint(out / "checkpoint-20")

    restored = gen.load_pretrained_checkpoint(out / "checkpoint-20", device="cpu",
                                              max_memory_bytes=4294967296)
    continued = restored.resume(training, validation, steps=10)
    print(f"validation loss after 30 updates: {continued.validation_loss():.4f}")
    continued.save_model(out / "domain-f32.gguf")
    gen.quantize_model(out / "domain-f32.gguf", out / "domain-q4.gguf", format="q4_0")
    adapter_manifest = continued.save_adapter(out / "domain-adapter")

    native = llm.load(source, context=128, device="cpu")
    specialized = native.with_adapter(adapter_manifest)
    ask(specialized, "After training (llama.cpp, base + adapter):")
    specialized.close()
    native.close()

    with llm.load(out / "domain-q4.gguf", context=128) as q4:
        ask(q4, "After training (llama.cpp, merged and quantized to q4_0):")
    print(f"\nArtifacts in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    print(f"Finished in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("out") / time.strftime("demo-%Y%m%d-%H%M%S"))
