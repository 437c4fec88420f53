"""Loops unrolled at compile time over tuples of registers (the wgmma accumulators of kernels/wgmma.py).

numba compiles `for i in range(n)` as a loop and NVVM leaves long ones rolled; a tuple indexed in such a loop is
indexed at run time, which puts it in local memory. These calls unroll while numba lowers them: the device function
`fn` is called once per index, in order, with the index as its first argument, and NVVM inlines each call with that
index a constant (device functions are forceinline): the straight-line code of the calls written out by hand.

    fill(n, value)                -> (value,) * n
    unroll(n, fn, carry, *args)   -> carry = fn(i, carry, *args) for i in range(n); the last carry
    tmap(fn, tup, *args)          -> (fn(0, tup[0], *args), fn(1, tup[1], *args), ...)
    tfold(fn, tup, carry, *args)  -> carry = fn(i, tup[i], carry, *args) for each i; the last carry
    pfold(fn, tup, carry, *args)  -> carry = fn(k, tup[2k], tup[2k + 1], carry, *args) for each pair k; the last carry
    each(fn, tup, *args)          -> fn(i, tup[i], *args) for each i (no result)
    each_pair(fn, tup, *args)     -> fn(k, tup[2k], tup[2k + 1], *args) for each pair k (no result)

n is a compile-time int: a literal or a closure constant (numba types those as literals), not an expression. A carry
keeps its type: fn returns what it is given. Under the simulator these are the plain Python loops.
"""
from numbaengine.kernels.device import SIM

if SIM:
    def fill(n, value):
        return (value,) * n

    def unroll(n, fn, carry, *args):
        for i in range(n):
            carry = fn(i, carry, *args)
        return carry

    def tmap(fn, tup, *args):
        return tuple(fn(i, x, *args) for i, x in enumerate(tup))

    def tfold(fn, tup, carry, *args):
        for i, x in enumerate(tup):
            carry = fn(i, x, carry, *args)
        return carry

    def pfold(fn, tup, carry, *args):
        for k in range(len(tup) // 2):
            carry = fn(k, tup[2 * k], tup[2 * k + 1], carry, *args)
        return carry

    def each(fn, tup, *args):
        for i, x in enumerate(tup):
            fn(i, x, *args)

    def each_pair(fn, tup, *args):
        for k in range(len(tup) // 2):
            fn(k, tup[2 * k], tup[2 * k + 1], *args)
else:
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    _INDEX = types.intp

    def _typed(typingctx, fn, argtys):
        """fn's signature for these argument types (compiling it), or a TypingError naming the call."""
        sig = typingctx.resolve_function_type(fn, tuple(argtys), {})
        if sig is None:
            raise TypingError(f"unroll: {fn} cannot take ({', '.join(map(str, argtys))})")
        return sig

    def _calls(typingctx, fn, count, items, carry, args):
        """The signature of each of the `count` calls fn(i, *items(i), [carry,] *args), carry's type kept."""
        sigs = []
        for i in range(count):
            sig = _typed(typingctx, fn, [_INDEX, *items(i), *([carry] if carry is not None else []), *args])
            if carry is not None and sig.return_type != carry:
                raise TypingError(f"unroll: {fn} returns {sig.return_type} for a carry of {carry}")
            sigs.append(sig)
        return sigs

    def _emit(ctx, b, fn, sig, i, values):
        """Lower the call fn(i, *values) with the index a constant."""
        return ctx.get_function(fn, sig)(b, [ir.Constant(ctx.get_value_type(_INDEX), i), *values])

    def _starred(b, star, n):
        return [b.extract_value(star, k) for k in range(n)]

    @intrinsic
    def fill(typingctx, n, value):
        """(value,) * n for a compile-time n."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        ty = types.unliteral(value)
        sig = types.UniTuple(ty, n.literal_value)(n, value)

        def codegen(ctx, b, sig, llargs):
            v = ctx.cast(b, llargs[1], value, ty)
            return ctx.make_tuple(b, sig.return_type, [v] * n.literal_value)
        return sig, codegen

    @intrinsic
    def unroll(typingctx, n, fn, carry, *args):
        """carry = fn(i, carry, *args) for i in range(n), n a compile-time int; the last carry."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        carry = types.unliteral(carry)
        sigs = _calls(typingctx, fn, n.literal_value, lambda i: (), carry, args)
        sig = carry(n, fn, carry, types.StarArgTuple(args))

        def codegen(ctx, b, sig, llargs):
            c, extra = llargs[2], _starred(b, llargs[3], len(args))
            for i, s in enumerate(sigs):
                c = _emit(ctx, b, fn, s, i, [c, *extra])
            return c
        return sig, codegen

    def _elements(tup):
        if not isinstance(tup, types.BaseTuple):
            raise TypingError(f"unroll: {tup} is not a tuple")
        return list(tup.types) if isinstance(tup, types.Tuple) else [tup.dtype] * tup.count

    @intrinsic
    def tmap(typingctx, fn, tup, *args):
        """(fn(i, tup[i], *args) for each i) as a tuple."""
        el = _elements(tup)
        sigs = _calls(typingctx, fn, len(el), lambda i: (el[i],), None, args)
        ret = types.BaseTuple.from_types([s.return_type for s in sigs])
        sig = ret(fn, tup, types.StarArgTuple(args))

        def codegen(ctx, b, sig, llargs):
            extra = _starred(b, llargs[2], len(args))
            out = [_emit(ctx, b, fn, s, i, [b.extract_value(llargs[1], i), *extra]) for i, s in enumerate(sigs)]
            return ctx.make_tuple(b, ret, out)
        return sig, codegen

    def _fold(pairs):
        """tfold (pairs False) or pfold (True)."""
        def fold(typingctx, fn, tup, carry, *args):
            el, carry = _elements(tup), types.unliteral(carry)
            step = 2 if pairs else 1
            sigs = _calls(typingctx, fn, len(el) // step, lambda k: el[step * k:step * k + step], carry, args)
            sig = carry(fn, tup, carry, types.StarArgTuple(args))

            def codegen(ctx, b, sig, llargs):
                c, extra = llargs[2], _starred(b, llargs[3], len(args))
                for k, s in enumerate(sigs):
                    items = [b.extract_value(llargs[1], step * k + e) for e in range(step)]
                    c = _emit(ctx, b, fn, s, k, [*items, c, *extra])
                return c
            return sig, codegen
        fold.__name__ = fold.__qualname__ = "pfold" if pairs else "tfold"
        fold.__doc__ = "carry = fn(k, tup[2k], tup[2k + 1], carry, *args) per pair k" if pairs else \
            "carry = fn(i, tup[i], carry, *args) per element i"
        return intrinsic(fold)

    def _each(pairs):
        """each (pairs False) or each_pair (True)."""
        def run(typingctx, fn, tup, *args):
            el, step = _elements(tup), 2 if pairs else 1
            sigs = _calls(typingctx, fn, len(el) // step, lambda k: el[step * k:step * k + step], None, args)
            sig = types.void(fn, tup, types.StarArgTuple(args))

            def codegen(ctx, b, sig, llargs):
                extra = _starred(b, llargs[2], len(args))
                for k, s in enumerate(sigs):
                    _emit(ctx, b, fn, s, k, [*(b.extract_value(llargs[1], step * k + e) for e in range(step)),
                                             *extra])
            return sig, codegen
        run.__name__ = run.__qualname__ = "each_pair" if pairs else "each"
        run.__doc__ = "fn(k, tup[2k], tup[2k + 1], *args) per pair k" if pairs else "fn(i, tup[i], *args) per i"
        return intrinsic(run)

    tfold, pfold = _fold(False), _fold(True)
    each, each_pair = _each(False), _each(True)
