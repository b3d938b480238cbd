"""Speculative decoding: drafters and their offers, the acceptance predictor, verification and the adaptive controller."""
