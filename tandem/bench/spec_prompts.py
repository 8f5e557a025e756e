"""The prompts of `tandem bench spec` (and `spec-steps`): per task, four prompts; the first of
each is the one-prompt benchmark's (before session 35), so `--prompts 1` reruns it."""

# Several prompts a task: in bf16 on the GPU the speculative side's text departs from plain
# decoding's after a few dozen tokens (the verify forward rounds differently), and from there
# the step count follows the text it happens to write: with one prompt, summarize at k 7 took
# 64 to 116 steps across three configurations of the same code (H100, session 35). A task's
# figure is the tok/s over all its prompts; the spread is reported beside it.
PASSAGES = [
    "The lighthouse stood at the end of a narrow spit of rock, and for forty years the same "
    "keeper had climbed its iron stairs every evening to light the lamp. Ships passing in the "
    "night saw its beam sweep across the water every twelve seconds, steady as a heartbeat. "
    "When the keeper finally retired, the town installed an automatic lamp, and the stairs "
    "gathered dust. But on stormy nights the fishermen still swore they could see a figure at "
    "the top of the tower, watching the sea, making sure the light never failed.\n\n"
    "Years later a young engineer came to inspect the automatic lamp. She found it in perfect "
    "order, its gears oiled and its lens polished, though no one in the town admitted to "
    "climbing the stairs. In the logbook on the keeper's desk, the last entry was dated the "
    "week he retired, but beneath it, in the same careful handwriting, someone had added a "
    "single line for every storm since: the date, the wind, and the words all ships safe. The "
    "engineer closed the book, put it back where she had found it, and wrote in her report "
    "that the lighthouse needed nothing at all.",
    "Every spring the river that runs through the valley floods its banks for about three "
    "weeks. The farmers who live there plant late on purpose, because the water leaves behind "
    "a layer of dark silt that feeds their fields for the rest of the year. Long ago the town "
    "council voted to build a dam upstream so that the floods would stop, and for a few years "
    "the valley stayed dry. The harvests grew smaller each season, and the soil turned pale "
    "and hard.\n\n"
    "An old farmer named Tomas kept records of every harvest in a blue notebook. He brought the "
    "notebook to a council meeting and read the numbers aloud, year by year, before and after "
    "the dam. Nobody argued with him. The next winter the council opened the gates of the dam "
    "again, and in spring the river came back over its banks. The farmers stood on the hills "
    "and watched the brown water spread across their fields, and some of them cheered.",
    "The library on Elm Street was the smallest in the city, with only four rooms and a single "
    "librarian, Mrs. Okafor, who had worked there for twenty-six years. She knew which children "
    "liked stories about dragons, which ones liked books about trains, and which ones came in "
    "only because it was warm. When the city announced that the library would close to save "
    "money, she did not protest. Instead she started a list of every person who came through "
    "the door, with the date and the book they borrowed.\n\n"
    "After three months the list filled two binders. She carried them to the city hall and "
    "left them on the mayor's desk with a short note that said: these are your readers. The "
    "mayor read the binders over a weekend. On Monday the decision to close the library was "
    "withdrawn, and a month later the city paid to repair its leaking roof and to buy new "
    "shelves for the children's room.",
    "Mount Arden is not the highest mountain in the range, but it is the one most climbers "
    "remember. Its north face is a wall of grey granite, smooth enough that for a long time "
    "people believed it could not be climbed at all. In the summer of 1961 two friends, Ada "
    "and Rhys, spent eleven days on the wall. They slept on narrow ledges, hauled their water "
    "up on ropes, and counted every piece of chocolate they had left.\n\n"
    "On the twelfth morning they reached the summit in thick fog and could see nothing at "
    "all, not even each other from a few metres apart. They left a small tin box under a pile "
    "of stones with their names and the date written inside, and began the long walk down the "
    "easier southern ridge. Forty years later a young climber found the tin box, still dry, "
    "and added her own name beneath theirs.",
]
# (code, the function to rename, its new name)
CODE_EDITS = [
    ('''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    averages = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(i, i + window):
            total += values[j]
        averages.append(total / window)
    return averages


def moving_average_spread(values, window):
    """Return the largest minus the smallest moving average."""
    averages = moving_average(values, window)
    if not averages:
        return 0
    return max(averages) - min(averages)


def main():
    data = [3, 5, 7, 2, 8, 10, 11, 65, 72, 81, 99, 100, 150]
    print(moving_average(data, 3))
    print(moving_average_spread(data, 3))
''', "moving_average", "rolling_mean"),
    ('''def count_words(text):
    """Return a dictionary from each word of `text` to how often it occurs."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def most_common_words(text, n):
    """Return the `n` most frequent words of `text`, most frequent first."""
    counts = count_words(text)
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    return [word for word, _ in ranked[:n]]


def main():
    text = "the cat sat on the mat and the dog sat on the cat"
    print(count_words(text))
    print(most_common_words(text, 3))
''', "count_words", "word_frequencies"),
    ('''class Account:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("the amount must be positive")
        self.balance += amount
        return self.balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("not enough money in the account")
        self.balance -= amount
        return self.balance


def transfer(source, target, amount):
    source.withdraw(amount)
    target.deposit(amount)
    return source.balance, target.balance
''', "withdraw", "take_out"),
    ('''def is_prime(n):
    """Return True if `n` is a prime number."""
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def primes_below(limit):
    """Return every prime number below `limit`."""
    return [n for n in range(limit) if is_prime(n)]


def main():
    print(primes_below(50))
    print(is_prime(97), is_prime(91))
''', "is_prime", "check_prime"),
]
CHATS = [
    "Write a short story about a robot who learns to paint. Be creative.",
    "Describe your ideal weekend in a small town by the sea.",
    "Invent a new board game and explain how to play it.",
    "Write a letter from a cat to its owner about the new dog in the house.",
]
TASKS = {
    "copy": [f"Repeat the following passage exactly, word for word:\n\n{p}" for p in PASSAGES],
    "summarize": [f"Summarize the following passage in a few sentences, reusing its wording:\n\n{p}"
                  for p in PASSAGES],
    "edit_code": [f"Rename the function {old} to {new} everywhere in this code and return the whole code:"
                  f"\n\n```python\n{code}```" for code, old, new in CODE_EDITS],
    "chat": CHATS,
}
# The answer's first words, given as the start of the assistant's turn (continue_final_message).
# Asked to edit plainly, the built-in 135M model echoed the instruction and went on to free
# chat (no code at all, 35 of 234 steps verified on the H200): opened as a code block, its
# answer is the edited code.
ANSWER_STARTS = {"edit_code": "```python\n"}
