"""The byte-level BPE vocabulary of pyllama's generated test models, built without training.

Layout (GPT-2 conventions, `tokenizer.ggml.model = 'gpt2'`):
- ids 0..255: the 256 bytes, id b = byte b, written with GPT-2's bytes_to_unicode mapping
  (so a space is 'Ġ', a newline 'Ċ'); token type 1 (normal);
- 256 '<s>' (BOS) and 257 '</s>' (EOS), token type 3 (control);
- 258..n_vocab-1: merged tokens, each the concatenation of two earlier tokens, in the order of
  `merges` (rank = position), token type 1.

The merges come from a fixed list of target strings in rough English-frequency order: frequent
letter pairs, then common words (with the GPT-2 leading space 'Ġ', capitalized, and bare),
suffixes, numbers, punctuation and whitespace runs, then English-like syllables, then (only for
very large vocabularies) concatenations of earlier tokens. Each target is first tokenized with
the merges made so far; while it is still more than one token, the leftmost adjacent pair whose
concatenation is not yet a token is merged, and that merge is appended. Because every new merge
ranks after all earlier ones and makes a new string, BPE applied with the final merge list
reproduces these segmentations, so common English words become one or a few tokens. Every
merged string is unique and both parts of each merge exist before it.
"""
from __future__ import annotations

import functools

BOS, EOS = "<s>", "</s>"
N_SPECIAL = 258  # 256 bytes + BOS + EOS
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_B2U = bytes_to_unicode()

# Frequent English letter pairs, most frequent first.
_BIGRAMS = ("th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io le ve "
            "co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur ca el ta la ns di fo ho pe ec pr no "
            "ct us ac ot il tr ly nc et ut ss so rs un lo wa ge ie wh ee wi em ad ol rt po we na ul ni ts "
            "mo ow pa im mi ai sh ir su id os iv ia am fi ci vi pl ig tu ev ld ry mp fe bl ab gh ty op wo "
            "sa ay ex ke fr oo av ag if ap gr od bo sp rd do uc bu ei ov by rm ep tt oc fa ef cu rn sc gi "
            "da yo cr cl du ga qu ue ff ba ey ls va um pp ua up lu go ht ru ug ds lt pi rc rr eg au ck ew "
            "mu br bi pt ak pu ui rg ib tl ny ki rk ys ob mm fu ph og ms ye ud mb ip ub oi rl gu dr hr cc "
            "tw ft wn ox").split()
_LETTERS_BY_FREQ = "etaoinshrdlcumwfgypbvkjxqz"
_UPPER_BY_FREQ = "TAISWHBMCOPDFNRLGEJKUYVQXZ"

# Common English words, roughly by frequency.
_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from or
had by not word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too same
tell does set three want air well also play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need house picture try
us again animal point mother world near build self earth father head stand own page should country
found answer school grow study still learn plant cover food sun four between state keep eye never last
let thought city tree cross farm hard start might story saw far sea draw left late run don't while
press close night real life few north open seem together next white children begin got walk example
ease paper group always music those both mark often letter until mile river car feet care second book
carry took science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk bird soon
body dog family direct pose leave song measure door product black short numeral class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay
against pattern slow center love person money serve appear road map rain rule govern pull cold notice
voice unit power town fine certain fly fall lead cry dark machine note wait plan figure star box noun
field rest correct able pound done beauty drive stood contain front teach week final gave green oh
quick develop ocean warm free minute strong special mind behind clear tail produce fact street inch
multiply nothing course stay wheel full force blue object decide surface deep moon island foot system
busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game
shape equate hot miss brought heat snow tire bring yes distant fill east paint language among grand
ball yet wave drop heart am present heavy dance engine position arm wide sail material size vary
settle speak weight general ice matter circle pair include divide syllable felt perhaps pick sudden
count square reason length represent art subject region energy hunt probable bed brother egg ride cell
believe fraction forest sit race window store summer train sleep prove lone exercise wall catch mount
wish sky board joy winter sat written wild instrument kept glass grass cow job edge sign visit past
soft fun bright gas weather month million bear finish happy hope flower clothe strange gone jump baby
eight village meet root buy raise solve metal whether push seven paragraph third shall held hair
describe cook floor either result burn hill safe cat century consider type law bit coast copy phrase
silent tall sand soil roll temperature finger industry value fight lie beat excite natural view sense
ear else quite broke case middle kill son lake moment scale loud spring observe child straight
consonant nation dictionary milk speed method organ pay age section dress cloud surprise quiet stone
tiny climb cool design poor lot experiment bottom key iron single stick flat twenty skin smile crease
hole trade melody trip office receive row mouth exact symbol die least trouble shout except wrote seed
tone join suggest clean break lady yard rise bad blow oil blood touch grew cent mix team wire cost lost
brown wear garden equal sent choose fell fit flow fair bank collect save control decimal gentle woman
captain practice separate difficult doctor please protect noon whose locate ring character insect
caught period indicate radio spoke atom human history effect electric expect crop modern element hit
student corner party supply bone rail imagine provide agree thus capital won't chair danger fruit rich
thick soldier process operate guess necessary sharp wing create neighbor wash bat rather crowd corn
compare poem string bell depend meat rub tube famous dollar stream fear sight thin triangle planet
hurry chief colony clock mine tie enter major fresh search send yellow gun allow print dead spot desert
suit current lift rose continue block chart hat sell success company subtract event particular deal
swim term opposite wife shoe shoulder spread arrange camp invent cotton born determine quart nine truck
noise level chance gather shop stretch throw shine property column molecule select wrong gray repeat
require broad prepare salt nose plural anger claim continent oxygen sugar death pretty skill women
season solution magnet silver thank branch match suffix especially fig afraid huge sister steel discuss
forward similar guide experience score apple bought led pitch coat mass card band rope slip win dream
evening condition feed tool total basic smell valley nor double seat arrive master track parent shore
division sheet substance favor connect post spend chord fat glad original share station dad bread charge
proper bar offer segment slave duck instant market degree populate chick dear enemy reply drink occur
support speech nature range steam motion path liquid log meant quotient teeth shell neck
""".split()
_WORDS = [w for w in _WORDS if w.isalpha()]  # "don't" is two pieces for the GPT-2 pre-tokenizer
_SUFFIXES = ("s es ed ing er ly ion tion ation ment ness able ible al ial ful less est ity ive ize ise ous "
             "ance ence ship hood ward wise ist ism ant ent ary ery ory age ure ism").split()
_PREFIXES = ("un re in dis en non over mis sub pre inter fore de trans super semi anti mid under").split()
_CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
_PUNCT = (".", ",", "?", "!", ":", ";", "...", "--", "\"", "'", "(", ")", "[", "]", "-", "/", "),", ").",
          ".\"", ",\"", "?\"", "!\"", "\".", "\",", "<", ">", "=", "==", "+", "*", "#", "{", "}", "_", "__")
_NUMBERS = tuple(str(i) for i in range(100)) + ("000", "00", "100", "1000", "2000", "2010", "2020", "19", "20")

# English-like syllables (onset + nucleus + coda), the filler after the lists above.
_ONSETS = ("", "t", "s", "r", "n", "l", "d", "m", "c", "p", "b", "h", "f", "g", "w", "st", "v", "k", "th", "tr", "pr",
           "ch", "sh", "br", "cr", "gr", "fr", "pl", "bl", "cl", "sp", "dr", "fl", "j", "wh", "y", "sc", "gl", "sl",
           "sw", "sm", "sn", "sk", "str", "qu", "z", "thr", "spr", "scr", "ph", "kn", "wr")
_NUCLEI = ("e", "a", "o", "i", "u", "ea", "ou", "ai", "ee", "y", "oo", "ie", "ay", "oa", "ow", "au", "oi", "ey", "ue")
_CODAS = ("", "n", "r", "s", "t", "l", "d", "nt", "nd", "st", "ng", "m", "ll", "ck", "ce", "re", "te", "ne", "se", "de",
          "le", "ve", "ss", "ct", "rt", "rs", "ns", "ts", "ke", "me", "pe", "ge", "k", "p", "g", "ch", "sh", "th", "x",
          "ft", "lt", "ld", "mp", "nk", "rd", "rk", "rm", "rn", "sk", "sp", "ds", "ls", "ms", "ps", "gs", "ks", "nce")


def _inflections(w: str) -> tuple[str, ...]:
    e = w.endswith("e") and not w.endswith("ee")
    plural = w + ("es" if w.endswith(("s", "x", "ch", "sh")) else "s")
    return plural, w + ("d" if e else "ed"), (w[:-1] if e else w) + "ing", w + ("r" if e else "er"), w + "ly"


def _targets():
    """The strings to make into tokens, in priority order (plain text)."""
    sp = " "
    yield from (sp + c for c in _LETTERS_BY_FREQ[:12])
    yield from _BIGRAMS[:40]
    yield from (sp + w for w in _WORDS[:25])
    yield from (sp + c for c in _LETTERS_BY_FREQ[12:])
    yield from (sp + c for c in _UPPER_BY_FREQ[:10])
    yield from _BIGRAMS[40:100]
    for i, w in enumerate(_WORDS):  # (targets already made cost nothing)
        if i == 50:
            yield from _BIGRAMS[100:]
        yield sp + w
        if i < 150:
            yield sp + w.capitalize()
        if i < 60:
            yield w.capitalize()
        if i < 400:
            yield w
        if i == 100:
            yield from _CONTRACTIONS
            yield from (sp + s for s in ("(", "\"", "-", "'", "[", "$", "=", "+", "*", "&", "—"))
            yield sp + sp
            yield "\n\n"
            yield sp * 4
            yield from (sp + n for n in "0123456789")
        if i == 200:
            yield from _SUFFIXES
            yield from _PUNCT
            yield from (sp + c for c in _UPPER_BY_FREQ[10:])
        if i == 300:
            yield from _NUMBERS
            yield from (sp + n for n in _NUMBERS[10:60])
            yield from (sp + p for p in _PREFIXES)
            yield sp * 8
            yield "\t\t"
            yield "\n" + sp * 4
    for w in _WORDS[:300]:
        yield from (sp + f for f in _inflections(w))
    for w in _WORDS[150:]:
        yield sp + w.capitalize()
    # syllables by increasing rank sum (then lexicographic rank order), with and without 'Ġ'
    combos = sorted(((a + b + c, a, b, c) for a in range(len(_ONSETS)) for b in range(len(_NUCLEI))
                     for c in range(len(_CODAS))))
    for _, a, b, c in combos:
        syl = _ONSETS[a] + _NUCLEI[b] + _CODAS[c]
        yield sp + syl
        yield syl


def _apply_bpe(word: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """BPE as llama.cpp and HF tokenizers do it: lowest-rank adjacent pair first, ties leftmost."""
    while len(word) > 1:
        best, best_i = None, -1
        for i in range(len(word) - 1):
            r = ranks.get((word[i], word[i + 1]))
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        word[best_i:best_i + 2] = [word[best_i] + word[best_i + 1]]
    return word


@functools.lru_cache(maxsize=8)
def _build(n_vocab: int) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    tokens = [_B2U[b] for b in range(256)] + [BOS, EOS]
    types = [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL, TOKEN_CONTROL]
    known = set(tokens)
    ranks: dict[tuple[str, str], int] = {}
    merges: list[str] = []

    def add(a: str, b: str) -> bool:
        s = a + b
        if s in known:
            return False
        known.add(s)
        ranks[(a, b)] = len(merges)
        merges.append(f"{a} {b}")
        tokens.append(s)
        types.append(TOKEN_NORMAL)
        return True

    def make(text: str) -> None:
        word = _apply_bpe([_B2U[b] for b in text.encode("utf-8")], ranks)
        while len(word) > 1 and len(tokens) < n_vocab:
            # merge the leftmost pair that makes a new token; apply it everywhere, as BPE would
            for i in range(len(word) - 1):
                if add(word[i], word[i + 1]):
                    a, b = word[i], word[i + 1]
                    break
            else:
                return
            j, out = 0, []
            while j < len(word):
                if j + 1 < len(word) and word[j] == a and word[j + 1] == b:
                    out.append(a + b)
                    j += 2
                else:
                    out.append(word[j])
                    j += 1
            word = out

    for target in _targets():
        if len(tokens) >= n_vocab:
            break
        make(target)
    # Very large vocabularies: concatenations of earlier merged tokens, shortest first.
    k = N_SPECIAL
    while len(tokens) < n_vocab:
        if k >= len(tokens):
            raise ValueError(f"cannot build a default vocabulary of {n_vocab} tokens")
        base = tokens[k]
        for j in range(N_SPECIAL, len(tokens)):
            if len(tokens) >= n_vocab:
                break
            if len(base) + len(tokens[j]) <= 16:
                add(base, tokens[j])
        k += 1
    return tuple(tokens), tuple(types), tuple(merges)


def build_default_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the default vocabulary with n_vocab tokens (>= 258)."""
    if not isinstance(n_vocab, int) or n_vocab < N_SPECIAL:
        raise ValueError(f"the default vocabulary needs at least {N_SPECIAL} tokens (256 bytes, BOS, EOS), got {n_vocab}")
    tokens, types, merges = _build(n_vocab)
    return list(tokens), list(types), list(merges)
