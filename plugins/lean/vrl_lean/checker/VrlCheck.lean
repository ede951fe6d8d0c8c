/-
VrlCheck: vrl's out-of-process re-check of one Lean pass (after lean4checker / comparator / SafeVerify).

  lake env lean --run VrlCheck.lean <candidate> <reference> <theorem_name> [<max_heartbeats>]

<candidate> and <reference> are each a compiled `.olean` file (a path ending in `.olean`) or a module
name found through LEAN_PATH (append the job directory to LEAN_PATH, never prepend it, so nothing
there can shadow Init/Lean/Mathlib). The candidate is the trusted header + the model's helpers +
`theorem NAME stmt := proof`; the reference is the trusted header + `theorem NAME stmt := sorry`.
Each was compiled by its own `lean -o` process; no code of either runs here: modules are read as
data, and only the candidate's imports are loaded.

Stdout: exactly one JSON line. Exit 0 whenever the check ran, whatever the verdict; exit 1 with a
message on stderr when it could not run (bad arguments, a missing `.olean`, an import that fails).

Written against the Lean v4.15.0 sources (Lean/Replay.lean, Lean/Util/CollectAxioms.lean,
Lean/Environment.lean, Lean/Util/Path.lean, Lean/Util/FoldConsts.lean, Lean/Data/Json). Elaborated
against a real Lean 4.28 (core, no Mathlib; tests/test_lean_wasm.py): every name, signature and
instance resolves there; code generation was not checked (that build cannot compile programs that
use library internals). It has not run against the kimina image's v4.15.0.
-/
import Lean
import Lean.Replay
open Lean

def vrlKind : ConstantInfo → String
  | .thmInfo _    => "theorem"
  | .defnInfo _   => "definition"
  | .axiomInfo _  => "axiom"
  | .opaqueInfo _ => "opaque"
  | .quotInfo _   => "quot"
  | .inductInfo _ => "inductive"
  | .ctorInfo _   => "constructor"
  | .recInfo _    => "recursor"

-- `toString`: `String.take` returns a `String` in v4.15 and a `String.Slice` in later versions.
def vrlClip (s : String) : String := if s.length ≤ 500 then s else toString (s.take 500) ++ "…"

/-- A module's imports and the constants it defines, read from its `.olean` as plain data. -/
def vrlLoad (arg : String) : IO (Array Import × Std.HashMap Name ConstantInfo) := do
  let file ← if arg.endsWith ".olean" then pure (System.FilePath.mk arg) else findOLean arg.toName
  unless (← file.pathExists) do
    throw <| IO.userError s!"no .olean at {file}"
  let (data, _) ← readModuleData file
  let mut consts : Std.HashMap Name ConstantInfo := {}
  for n in data.constNames, ci in data.constants do
    consts := consts.insert n ci
  return (data.imports, consts)

/-- `seen` plus the constants of `cs` that `n` reaches through types and values (`n` included). -/
partial def vrlReach (cs : Std.HashMap Name ConstantInfo) (n : Name) (seen : NameSet) : NameSet :=
  match cs[n]? with
  | none => seen
  | some ci => Id.run do
    if seen.contains n then return seen
    let mut s := seen.insert n
    for m in ci.getUsedConstantsAsSet do
      s := vrlReach cs m s
    return s

/-- Send `n` and, first, the candidate constants it uses through the kernel, under the options of the
`CoreM` context (the header's heartbeat limit). Unsafe and `partial` constants are skipped (reported
below); an inductive type, constructor, recursor or quotient is refused: the policy accepts none, and
its generated parts would need checks of their own. -/
partial def vrlReplay (cand : Std.HashMap Name ConstantInfo) (n : Name) : StateT NameSet CoreM Unit := do
  if (← get).contains n then return
  let some ci := cand[n]? | return
  modify (·.insert n)
  if ci.isUnsafe || ci.isPartial then return
  for m in ci.getUsedConstantsAsSet do
    vrlReplay cand m
  match ci with
  | .defnInfo v   => addDecl (.defnDecl v)
  | .thmInfo v    => addDecl (.thmDecl v)
  | .opaqueInfo v => addDecl (.opaqueDecl v)
  | .axiomInfo v  => addDecl (.axiomDecl v)
  | _ => throwError "{n} is a {vrlKind ci}: not replayed (no inductive types are accepted)"

def vrlCheck (candArg refArg : String) (thm : Name) (heartbeats : Nat) : IO Json := do
  let (candImports, cand) ← vrlLoad candArg
  let (refImports, refCs) ← vrlLoad refArg
  let some refCi := refCs[thm]?
    | throw <| IO.userError s!"{thm} is not declared in the reference {refArg}"
  let mut errs : Array String := #[]
  -- 1. Same imports as the reference: the candidate did not widen the trusted header.
  if candImports.map (·.module) != refImports.map (·.module) then
    errs := errs.push "imports: the candidate's imports differ from the reference's"
  -- 2. Kernel replay: a fresh environment holding only the candidate's imports, then every constant
  -- the candidate module defines goes through the kernel again, dependencies first (`vrlReplay`), with
  -- the header's heartbeat limit (Lean's `Environment.replay` passes empty options: the default
  -- 200000, so an honest proof between the two limits would time out here). A declaration that
  -- entered the environment without a kernel check (skipKernelTC, environment hacking) fails here.
  let env ← importModules candImports {}
  let mut env' := env
  let mut replayOk := false
  let opts : Options := maxHeartbeats.set {} heartbeats
  try
    let run := (cand.toList.map (·.1)).forM (vrlReplay cand) |>.run' {}
    let (_, st) ← run.toIO { fileName := "<vrl-check>", fileMap := default, options := opts } { env := env }
    env' := st.env
    replayOk := true
  catch e =>
    errs := errs.push s!"replay: {e}"
  let replayed := if replayOk then (cand.toList.filter fun (_, ci) => !ci.isUnsafe && !ci.isPartial).length else 0
  -- 3. NAME as the kernel now holds it (as the .olean has it, if the replay failed).
  let candCi? := if replayOk then env'.find? thm else cand[thm]?
  let kind := match candCi? with
    | some ci => vrlKind ci
    | none => "missing"
  -- 4. The statement: NAME's type is the same Expr (same universe names) as the reference's, and each
  -- constant of the reference module that the statement uses (e.g. a `match_1` auxiliary) is defined
  -- the same way in the candidate.
  let mut stmtDeps : NameSet := {}
  for c in refCi.type.getUsedConstantsAsSet do
    stmtDeps := vrlReach refCs c stmtDeps
  let mut depsSame := true
  for c in stmtDeps do
    match refCs[c]?, cand[c]? with
    | some r, some k => depsSame := depsSame && r.type == k.type && r.value? == k.value?
    | _, _ => depsSame := false
  let typeMatches := match candCi? with
    | some ci => ci.type == refCi.type && ci.levelParams == refCi.levelParams && depsSame
    | none => false
  -- 5. The axioms NAME depends on, collected as `#print axioms` does, in the replayed environment.
  let mut axioms : Array Name := #[]
  if replayOk then
    let (_, st) := ((CollectAxioms.collect thm).run env').run {}
    axioms := st.axioms
  -- 6. Candidate constants NAME depends on that are unsafe or partial (a `partial def f` is an
  -- opaque `f` beside an unsafe `f._unsafe_rec`), and every axiom the candidate module declares.
  let mut unsafeDeps : Array String := #[]
  for n in vrlReach cand thm {} do
    if let some ci := cand[n]? then
      if ci.isUnsafe || ci.isPartial || cand.contains (Name.mkStr n "_unsafe_rec") then
        unsafeDeps := unsafeDeps.push n.toString
  let declared := cand.toList.filterMap fun (n, ci) =>
    if ci matches .axiomInfo _ then some n.toString else none
  let candType := match candCi? with
    | some ci => toString ci.type
    | none => ""
  let err? : Option String := if errs.isEmpty then none else some ("; ".intercalate errs.toList)
  return Json.mkObj [
    ("vrl_check", toJson (1 : Nat)),
    ("name", toJson thm.toString),
    ("replayed", toJson replayed),
    ("kind", toJson kind),
    ("type_matches", toJson typeMatches),
    ("candidate_type", toJson (vrlClip candType)),
    ("reference_type", toJson (vrlClip (toString refCi.type))),
    ("axioms", toJson (axioms.map (·.toString))),
    ("unsafe", toJson unsafeDeps),
    ("declared_axioms", toJson declared.toArray),
    ("error", toJson err?)]

def main (args : List String) : IO UInt32 := do
  let (files, heartbeats) := match args with
    | [c, r, t, hb] => ([c, r, t], hb.toNat?.getD 0)
    | other => (other, 200000)
  match files with
  | [cand, refArg, thm] =>
    try
      if heartbeats == 0 then throw <| IO.userError "max_heartbeats must be a positive number"
      initSearchPath (← findSysroot)  -- the toolchain's lib/lean, after the LEAN_PATH entries
      let out ← vrlCheck cand refArg thm.toName heartbeats
      IO.println out.compress
      return 0
    catch e =>
      IO.eprintln s!"VrlCheck could not run: {e}"
      return 1
  | _ =>
    IO.eprintln "usage: lean --run VrlCheck.lean <candidate(.olean)> <reference(.olean)> <theorem_name> [<max_heartbeats>]"
    return 1
