"""Requests and the scheduler's parts: admission order, running rows, sampling, completion."""
