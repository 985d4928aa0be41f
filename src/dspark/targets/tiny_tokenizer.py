"""The `tiny` target's tokenizer, built offline: byte-level BPE trained on a small built-in corpus.

Tests and debug runs need a real tokenizer with a chat template, an end-of-turn token and a reserved MASK token,
without touching the network. Byte-level BPE can encode any text (no unknown tokens); the ~512-entry vocabulary
keeps the tiny model's embedding and LM head small. The corpus mixes English, arithmetic and Python so that
every prompt domain the data module generates tokenizes into a reasonable number of pieces.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of turn = eos
PAD = "<|pad|>"
MASK = "<|mask|>"  # the drafter's MASK row (METHOD §2.1); never produced by encoding ordinary text
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, PAD, MASK]

# ChatML without a default system turn: the prompt is exactly the messages given.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ENGLISH = """\
The quick brown fox jumps over the lazy dog.
You are a helpful assistant. Answer the question clearly and explain each step.
Please write a short story about a robot who learns to paint.
What is the capital of France? The capital of France is Paris.
Summarize the following paragraph in one sentence.
Explain why the sky is blue. Sunlight is scattered by the molecules in the air, and blue light scatters most.
Give three tips for staying healthy: eat well, sleep enough, and exercise every day.
The meeting was moved to Thursday because the manager was travelling.
Write a polite email asking for a deadline extension on the project report.
A good teacher listens carefully, asks questions, and gives honest feedback.
Translate the sentence into French and then into Spanish.
In the morning the town was quiet, and the river reflected the mountains.
Compare the two approaches and list their advantages and disadvantages.
If it rains tomorrow, we will stay inside and read books.
She said that the results were interesting but needed more data.
"""

_MATH = """\
Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.
How many clips did Natalia sell altogether in April and May? 48 / 2 = 24, and 48 + 24 = 72. The answer is 72.
Solve for x: 3x + 5 = 20. Subtract 5 from both sides: 3x = 15, so x = 5.
Find the area of a circle with radius 4. The area is pi * r^2 = 16 * pi.
What is the sum of the first 10 positive integers? The sum is 10 * 11 / 2 = 55.
A train travels 120 miles in 2 hours. What is its average speed? 120 / 2 = 60 miles per hour.
Let f(x) = x^2 - 4x + 3. The roots are x = 1 and x = 3.
Compute 7 * 8 = 56, 9 * 6 = 54, 12 * 12 = 144, and 100 - 37 = 63.
The probability of rolling a sum of 7 with two dice is 6 / 36 = 1 / 6.
If a = 2 and b = 3, then a^2 + b^2 = 13 and (a + b)^2 = 25.
Therefore, the final answer is \\boxed{42}.
"""

_CODE = '''\
def add(a, b):
    """Return the sum of a and b."""
    return a + b


def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()


for i in range(10):
    print(i, i * i)

numbers = [3, 1, 4, 1, 5, 9, 2, 6]
result = sorted(set(numbers))
if len(result) > 0 and result[0] == 1:
    print("first is one")
import math
def is_prime(n: int) -> bool:
    return n > 1 and all(n % k != 0 for k in range(2, int(math.sqrt(n)) + 1))
'''


def training_corpus() -> list[str]:
    """The fixed lines the BPE merges are learnt from (plus generated arithmetic, so digits merge sensibly)."""
    lines = [*_ENGLISH.splitlines(), *_MATH.splitlines(), *_CODE.splitlines()]
    lines += [f"{a} + {b} = {a + b} and {a} * {b} = {a * b}." for a in range(0, 30, 3) for b in range(1, 20, 4)]
    lines += [f"<|im_start|>{role}\n{text}<|im_end|>" for role, text in (("user", "Hello!"), ("assistant", "Hi."))]
    return lines


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `training_corpus()` and wrap it with ChatML specials and template.

    Specials: eos = `<|im_end|>` (end of turn), pad = `<|pad|>`, mask = `<|mask|>`, plus `<|im_start|>` and
    `<|endoftext|>`. Deterministic for a given corpus; the tiny target caches the result on disk anyway.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        mask_token=MASK,
        extra_special_tokens=[IM_START, END_OF_TEXT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
