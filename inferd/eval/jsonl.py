"""JSON Lines files (eval sets, and the bench traces and rollout probe sets, which import it from here: eval is the
layer both may reach): their lines."""


def jsonl_lines(text: str) -> list[tuple[int, str]]:
    """A JSONL text's non-blank lines with their numbers (from 1). Lines end at \\n only: str.splitlines would also
    end one at U+2028, U+2029 or U+0085, which a JSON string may hold unescaped."""
    return [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]
