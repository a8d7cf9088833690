"""inferd bench: open- and closed-loop load against any OpenAI-compatible endpoint, SLO reports, capacity sweeps."""
