"""``composer generate``: a run trained on the built-in corpus, its export and a Hugging Face
folder give the same greedy ids; the ids are the model's argmax continuation; streaming prints
exactly the final text; prompts, chat templates and stop ids match ``transformers``; every
mistake is one line and exit code 2."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from composer.cli import main
from composer.cli.generate import Stream
from composer.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TINY = ["--set", "d_model=32", "--set", "mamba.n_heads=2", "--set", "mamba.d_head=16",
        "--set", "mamba.d_state=16", "--set", "mamba.chunk_size=16", "--set", "mlp.d_ff=64"]
SPEEDS = ("prefill_tokens_per_s", "decode_tokens_per_s", "wall_s")
SENTENCES = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
             "the early bird catches the worm", "all that glitters is not gold"]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
CHAT_TEMPLATE = """{{ bos_token -}}
{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('roles are system, user and assistant') }}
{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def generate(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys, *args) -> dict:
    code, out, err = generate(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny byte-level hybrid trained for 3 steps on the built-in corpus."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    assert main(["train", "--config", "shakespeare", "--steps", "3", "--seq-len", "64",
                 "--global-batch-size", "4", "--eval-every", "0", "--json", *TINY,
                 "--save", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A Llama-3-like tokenizer folder: byte-level BPE, BOS added by the post-processor, a chat
    template."""
    import tokenizers  # the test extra installs it
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    folder = tmp_path_factory.mktemp("bpe") / "tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory, bpe):
    """A random tiny Llama with the BPE tokenizer's vocabulary: the composer checkpoint (no
    tokenizer) and its Hugging Face export with the tokenizer files beside it."""
    root = tmp_path_factory.mktemp("llama")
    vocab = HFTokenizer(bpe).vocab_size
    assert main(["build", "--pattern", "*-*-", "--set", f"vocab_size={vocab}", "--set",
                 "d_model=32", "--set", "attention.n_heads=4", "--set", "attention.n_kv_heads=2",
                 "--set", "attention.d_head=8", "--set", "mlp.d_ff=64", "--seed", "3",
                 "--out", str(root / "ours"), "--json"]) == 0
    assert main(["convert", "to-hf", str(root / "ours"), str(root / "hf"), "--json"]) == 0
    for path in bpe.iterdir():
        shutil.copy(path, root / "hf" / path.name)
    return root / "ours", root / "hf"


def greedy_reference(folder, prompt_ids: list[int], n: int) -> list[int]:
    """Argmax continuation by a full forward per token (no cache)."""
    from composer.parallel.mesh import ParallelConfig
    from composer.run import prepare

    model = prepare(str(folder), ParallelConfig(), device="cpu")[0].eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def test_a_run_keeps_its_tokenizer_and_streams_its_greedy_text(run, capsys):
    assert isinstance(load_tokenizer(str(run / "tokenizer")), ByteTokenizer)
    info = generate_json(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 8)
    code, out, err = generate(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 8)
    assert code == 0
    assert out == info["text"] + "\n"  # what streamed is the final text, nothing held back
    assert err.startswith(f"{info['n_new_tokens']} new tokens ({info['finish_reason']}) in ")
    assert info["token_ids"] == greedy_reference(run, list(b"ROMEO:"), 8)[:len(info["token_ids"])]


def test_a_run_on_prepared_data_keeps_that_tokenizer(bpe, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in SENTENCES * 8))
    assert main(["data", "prepare", str(docs), "--out", str(tmp_path / "ds"), "--tokenizer",
                 str(bpe), "--append-eod", "--json"]) == 0
    assert main(["train", "--config", "shakespeare", "--data", str(tmp_path / "ds"), "--split",
                 "100,0,0", "--seq-len", "16", "--steps", "1", "--global-batch-size", "2",
                 "--eval-every", "0", *TINY, "--set", f"vocab_size={HFTokenizer(bpe).vocab_size}",
                 "--save", str(tmp_path / "run"), "--json"]) == 0
    saved = tmp_path / "run" / "tokenizer"
    assert sorted(p.name for p in saved.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert (saved / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    capsys.readouterr()
    info = generate_json(capsys, tmp_path / "run", "--prompt", "the early", "--max-new-tokens", 2)
    assert info["prompt_token_ids"] == HFTokenizer(bpe).encode_prompt("the early")


def test_json_fields_are_consistent(run, capsys, tmp_path):
    (tmp_path / "prompt.txt").write_text("ROMEO:")
    info = generate_json(capsys, run, "--prompt-file", tmp_path / "prompt.txt",
                         "--max-new-tokens", 8)
    assert {"text", "token_ids", "n_prompt_tokens", "n_new_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s"} <= set(info)
    assert info["prompt_token_ids"] == list(b"ROMEO:") and info["n_prompt_tokens"] == 6
    assert info["n_new_tokens"] == len(info["token_ids"]) <= 8
    ended = info["finish_reason"] == "eos"
    assert ended == (info["token_ids"][-1] == ByteTokenizer.eod)
    assert ended or info["n_new_tokens"] == 8
    assert info["text"] == ByteTokenizer().decode(info["token_ids"])
    assert info["prefill_tokens_per_s"] > 0
    assert info["decode_tokens_per_s"] > 0 or info["n_new_tokens"] == 1


def test_export_keeps_the_tokenizer_and_the_greedy_ids(run, capsys, tmp_path):
    assert main(["export", str(run), str(tmp_path / "portable")]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "portable" / "tokenizer").iterdir()) == \
        ["tokenizer_config.json"]
    ours = generate_json(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 8)
    exported = generate_json(capsys, tmp_path / "portable", "--prompt", "ROMEO:",
                             "--max-new-tokens", 8)
    assert exported["token_ids"] == ours["token_ids"]


@pytest.mark.slow
def test_a_hugging_face_folder_gives_the_checkpoints_ids(llama, bpe, capsys, tmp_path):
    from transformers import AutoTokenizer

    ours, hf = llama
    prompt = "the quick brown fox"
    from_hf = generate_json(capsys, hf, "--prompt", prompt, "--max-new-tokens", 8)
    direct = generate_json(capsys, ours, "--tokenizer", bpe, "--prompt", prompt,
                           "--max-new-tokens", 8)
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "converted")]) == 0
    capsys.readouterr()  # the converted checkpoint finds the tokenizer in its hf/
    converted = generate_json(capsys, tmp_path / "converted", "--prompt", prompt,
                              "--max-new-tokens", 8)
    assert converted == {**from_hf, **{k: converted[k] for k in SPEEDS}}
    expected = AutoTokenizer.from_pretrained(hf)(prompt)["input_ids"]
    assert from_hf["prompt_token_ids"] == direct["prompt_token_ids"] == expected
    assert expected[0] == HFTokenizer(bpe).encode("<|begin_of_text|>")[0]  # the BOS
    assert from_hf["token_ids"] == direct["token_ids"]
    assert from_hf["token_ids"] == greedy_reference(ours, expected, 8)[:len(direct["token_ids"])]


def test_generation_config_eos_ids_stop_decoding(llama, capsys, tmp_path):
    _, hf = llama
    folder = tmp_path / "hf"
    shutil.copytree(hf, folder)
    full = generate_json(capsys, folder, "--prompt", "a stitch", "--max-new-tokens", 8)
    ids = full["token_ids"]
    stop = ids[min(2, len(ids) - 1)]
    eod = HFTokenizer(folder).eod
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eod, stop]}))
    cut = generate_json(capsys, folder, "--prompt", "a stitch", "--max-new-tokens", 8)
    first = next(k for k, i in enumerate(ids) if i in (eod, stop))
    assert cut["token_ids"] == ids[:first + 1] and cut["finish_reason"] == "eos"
    assert cut["text"] == HFTokenizer(folder).decode(ids[:first])


def test_chat_renders_and_encodes_as_transformers(llama, bpe, capsys):
    from transformers import AutoTokenizer

    _, hf = llama
    messages = [{"role": "user", "content": " the lazy dog \n"}]
    ref = AutoTokenizer.from_pretrained(hf)
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert HFTokenizer(bpe).apply_chat_template(messages, add_generation_prompt=True) == text
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    info = generate_json(capsys, hf, "--chat", "--prompt", messages[0]["content"],
                         "--max-new-tokens", 2)
    assert info["prompt_token_ids"] == list(ids)
    with pytest.raises(ValueError) as exc:
        HFTokenizer(bpe).apply_chat_template([{"role": "robot", "content": "hi"}])
    assert str(exc.value) == (f"tokenizer {bpe}: the chat template failed (TemplateError: "
                              "roles are system, user and assistant)")


@pytest.mark.slow
def test_sampling_is_reproducible_with_a_seed(run, capsys):
    def ids(*flags) -> list[int]:
        return generate_json(capsys, run, "--prompt", "ROMEO:", "--max-new-tokens", 8,
                             *flags)["token_ids"]

    sampled = ids("--temperature", 1, "--seed", 3)
    assert sampled == ids("--temperature", 1, "--seed", 3)
    assert sampled != ids("--temperature", 1, "--seed", 4)
    greedy = ids()
    assert ids("--temperature", 1, "--top-k", 1, "--seed", 5) == greedy
    assert ids("--temperature", 1, "--top-p", 1e-6, "--seed", 5) == greedy


def test_stream_holds_back_incomplete_utf8():
    out = io.StringIO()
    stream = Stream(ByteTokenizer(), {ByteTokenizer.eod}, out)
    seen = []
    for i in [*"Ré✓".encode(), ByteTokenizer.eod, *b"after"]:
        stream.add(i)
        seen.append(out.getvalue())
    assert seen == ["R", "R", "Ré", "Ré", "Ré", "Ré✓", "Ré✓", *["Ré✓"] * 5]
    stream.finish()
    assert out.getvalue() == "Ré✓\n"


PROMPT = ["--prompt", "ROMEO:"]


def _errors(run, llama, bpe, tmp_path) -> list[tuple[list, str]]:
    ours, _ = llama
    (tmp_path / "empty.txt").write_text("")
    big = max(HFTokenizer(bpe).encode_prompt("the quick brown fox"))
    assert big >= 257  # the BPE tokenizer's merges lie past the byte model's vocabulary
    gen = "generate: "
    return [
        ([run, "--prompt", ""], "the prompt is empty"),
        ([run, "--prompt-file", tmp_path / "empty.txt"], "the prompt is empty"),
        ([run, "--prompt-file", tmp_path / "nope.txt"],
         f"--prompt-file {tmp_path / 'nope.txt'}: no such file"),
        ([run, *PROMPT, "--max-new-tokens", 0], "--max-new-tokens must be >= 1, got 0"),
        ([run, *PROMPT, "--max-new-tokens", -2], "--max-new-tokens must be >= 1, got -2"),
        ([run, *PROMPT, "--top-k", 0], "--top-k must be >= 1, got 0"),
        ([run, *PROMPT, "--top-p", 0], "--top-p must be in (0, 1], got 0.0"),
        ([run, *PROMPT, "--top-p", 1.5], "--top-p must be in (0, 1], got 1.5"),
        ([run, *PROMPT, "--temperature", -1], "--temperature must be >= 0, got -1.0"),
        ([run, *PROMPT, "--prompt-file", tmp_path / "empty.txt"],
         gen + "argument --prompt-file: not allowed with argument --prompt"),
        ([run], gen + "one of the arguments --prompt --prompt-file is required"),
        ([tmp_path / "missing", *PROMPT],
         f"{tmp_path / 'missing'}: not a checkpoint (a portable checkpoint has config.yaml, a "
         "`composer train --save` folder has 'latest', a Hugging Face folder has a config.json "
         "with architectures)"),
        ([ours, *PROMPT],
         f"{ours}: no tokenizer found (looked in {ours}/tokenizer/ and {ours}/hf/); give "
         "--tokenizer (byte, a tokenizer folder, a dataset prefix or a hub id)"),
        ([run, "--tokenizer", bpe, "--prompt", "the quick brown fox"],
         f"the prompt's token ids reach {big}, past the model's vocabulary of 257; is the "
         f"tokenizer ({bpe}) the model's?"),
        ([run, *PROMPT, "--chat"],
         "--chat: tokenizer byte: the byte tokenizer has no chat template"),
    ]


@pytest.mark.slow
def test_mistakes_are_one_line_and_exit_2(run, llama, bpe, tmp_path, capsys):
    for args, message in _errors(run, llama, bpe, tmp_path):
        code, out, err = generate(capsys, *args)
        assert (code, out, err) == (2, "", f"composer: error: {message}\n"), args


def _tiny_model(folder, vocab: int) -> None:
    assert main(["build", "--pattern", "*-", "--set", f"vocab_size={vocab}", "--set",
                 "d_model=16", "--set", "attention.n_heads=2", "--set", "attention.n_kv_heads=1",
                 "--set", "attention.d_head=8", "--set", "mlp.d_ff=32", "--seed", "1",
                 "--out", str(folder), "--json"]) == 0


def test_a_tokenizer_without_eod_generates_to_max_new_tokens(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "c": 2, "[UNK]": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert HFTokenizer(tmp_path / "tok").eod is None  # transformers loads it too
    _tiny_model(tmp_path / "m", 4)
    capsys.readouterr()
    code, out, err = generate(capsys, tmp_path / "m", "--tokenizer", tmp_path / "tok",
                              "--prompt", "a b", "--max-new-tokens", 6, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["finish_reason"], info["n_new_tokens"]) == ("length", 6)
    assert err == (f"composer generate: tokenizer {tmp_path / 'tok'} has no end-of-document "
                   "token: generating --max-new-tokens (6) tokens\n")


def test_a_model_vocabulary_padded_past_the_tokenizer_generates_decodable_ids(tmp_path,
                                                                            capsys):
    from safetensors.torch import load_file, save_file

    _tiny_model(tmp_path / "m", 320)
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    # rows the byte tokenizer can decode score 0: unmasked, greedy picks a padded row
    tensors["lm_head.weight"][:257] = 0.0
    save_file(tensors, path)
    capsys.readouterr()
    code, out, err = generate(capsys, tmp_path / "m", "--tokenizer", "byte", "--prompt", "hi",
                              "--max-new-tokens", 8, "--json")
    assert code == 0, err
    ids = json.loads(out)["token_ids"]
    assert len(ids) >= 1 and max(ids) < 257
    assert err == ("composer generate: the model's vocabulary (320) is larger than the "
                   "tokenizer's (257): ids 257..319 have no text and are never generated\n")
