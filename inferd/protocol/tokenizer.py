"""What gateway and replica need of a model's tokenizer (inferd.models.tokenizer.Tokenizer is one)."""
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Raises ValueError when the model has no template or it fails to render."""
        ...
