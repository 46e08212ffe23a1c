"""Plumbing any layer may use: errors, environment, threads, CPU placement, command lines."""
