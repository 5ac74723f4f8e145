"""Mixture-of-experts layers: routing, the expert computation, expert placement across ranks,
the token exchange between them, and load balancing (EPLB)."""
