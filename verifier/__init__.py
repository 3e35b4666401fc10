"""The verifier service (docs/architecture.md, "The services"). Services never import each other; shared
code lives in tandem."""
