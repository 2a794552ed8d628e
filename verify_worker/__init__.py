"""Verify worker: holds the target model, verifies draft blocks, commits tokens to each request's stream."""
