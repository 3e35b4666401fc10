"""The verifier service (see DESIGN.md §2). Services never import each other; shared code lives in tandem."""
