"""Reading a run back for people: its card (run_card.py), Markdown-safe text and saved figures (markdown.py), and
what the card reads of a `dptrain bench` sweep the run belongs to (sweep_files.py). Torch-free."""
