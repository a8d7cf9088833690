"""The quality layer: a versioned document-QA set (evals/), scored deterministically with intervals, run
against any OpenAI-compatible endpoint over HTTP like a user (`inferd eval`, the release gate, the canary)."""
