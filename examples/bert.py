"""bert from transformers: plan at scale on the meta device, run the plan on 4 CPU processes (see hf_example.py)."""

from hf_example import main

if __name__ == "__main__":
    main("bert")
