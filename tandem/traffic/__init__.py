"""Capture of served traffic (tokens + EAGLE-3 features of finished requests) for drafter training."""
