"""`python -m hf_radix.lm_eval_backend ...`: lm-eval's CLI with "hf-radix" registered."""

from . import main

if __name__ == "__main__":
    main()
