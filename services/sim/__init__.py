"""Offline simulation of a prefill/decode cluster: cost profiles and a discrete-event
simulator that drives the conductor's policy objects over a trace."""
