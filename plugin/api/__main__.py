"""`python -m triton_sampling_mask.api --triton-url localhost:8001 --port 9000 [--model-path DIR]`."""

from .app import main

if __name__ == "__main__":
    main()
