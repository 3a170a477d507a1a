"""``data.tokenizer``: text to token ids.

* ``bytes`` (the default): the UTF-8 bytes, 256 ids, no file needed;
* a local Hugging Face tokenizer folder: its ``tokenizer.json`` read by the ``tokenizers``
  library, or else ``transformers.AutoTokenizer`` with ``local_files_only`` (nothing is
  downloaded);
* ``tiktoken:NAME`` (``tiktoken:gpt2``, ``tiktoken:cl100k_base``): an encoding of the optional
  ``tiktoken`` package; tiktoken fetches its BPE files from the network on first use, so on a
  machine without one the encoding must already be in its cache (``TIKTOKEN_CACHE_DIR``);
  otherwise the error says so.

Documents are separated by the tokenizer's end-of-text id when it has one (``<|endoftext|>``,
``</s>``, ``[SEP]``...), else by nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fxpipe.errors import SpecError

#: special tokens tried, in order, as the separator between documents
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


@dataclass
class Tokenizer:
    """A loaded ``data.tokenizer``.

    Attributes:
        name: as the spec gives it.
        vocab_size: ids are in ``[0, vocab_size)``.
        encode: text -> list of ids.
        eos_id: the id put between documents, or None.
    """

    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]
    eos_id: int | None = None

    def encode_document(self, text: str) -> list[int]:
        """``text``'s ids followed by the end-of-text id (when the tokenizer has one)."""
        ids = self.encode(text)
        return ids + [self.eos_id] if self.eos_id is not None else ids


def _bytes_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def load_tokenizer(name: str, where: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer ``name`` names (see the module doc).

    Raises:
        SpecError: no such folder, a folder with no tokenizer, the optional package missing,
            a tiktoken encoding that would need the network.
    """
    if name == "bytes":
        return Tokenizer("bytes", 256, _bytes_encode, None)
    if name.startswith("tiktoken:"):
        return _tiktoken(name, where)
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise SpecError(f"{where}: {name!r} is neither 'bytes', 'tiktoken:NAME' nor a folder "
                        "(a local Hugging Face tokenizer: tokenizer.json, or the files "
                        "AutoTokenizer reads); nothing is downloaded")
    if (folder / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise SpecError(f"{where}: reading {folder}/tokenizer.json needs the 'tokenizers' "
                            "package: pip install 'fxpipe[data]'") from None
        try:
            tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library's own parse errors
            raise SpecError(f"{where}: {folder}/tokenizer.json cannot be read: "
                            f"{' '.join(str(e).split())[:200]}") from None
        eos = next((tok.token_to_id(t) for t in _EOS_NAMES if tok.token_to_id(t) is not None),
                   None)
        return Tokenizer(name, tok.get_vocab_size(with_added_tokens=True),
                         lambda text: tok.encode(text, add_special_tokens=False).ids, eos)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SpecError(f"{where}: {folder} has no tokenizer.json, and reading it with "
                        "AutoTokenizer needs transformers: pip install 'fxpipe[hf]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise SpecError(f"{where}: {folder} holds no tokenizer that AutoTokenizer can read "
                        f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); save one "
                        "there with tokenizer.save_pretrained(folder)") from None
    return Tokenizer(name, len(tok), lambda text: tok.encode(text, add_special_tokens=False),
                     tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id)


def _tiktoken(name: str, where: str) -> Tokenizer:
    enc_name = name.split(":", 1)[1]
    try:
        import tiktoken
    except ImportError:
        raise SpecError(f"{where}: {name} needs the 'tiktoken' package: pip install "
                        "'fxpipe[data]'") from None
    if enc_name not in tiktoken.list_encoding_names():
        raise SpecError(f"{where}: tiktoken has no encoding {enc_name!r}; it has "
                        f"{', '.join(tiktoken.list_encoding_names())}")
    try:
        enc = tiktoken.get_encoding(enc_name)
    except Exception as e:  # the download of its BPE file failed
        raise SpecError(f"{where}: tiktoken could not load {enc_name!r} ({type(e).__name__}); "
                        "tiktoken fetches its BPE files from the network on first use and "
                        "fxpipe downloads nothing: load it once on a machine with a network and "
                        "copy its cache (TIKTOKEN_CACHE_DIR), or use a local tokenizer folder "
                        "or 'bytes'") from None
    return Tokenizer(name, enc.n_vocab, lambda text: enc.encode_ordinary(text), enc.eot_token)
