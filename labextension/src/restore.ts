/**
 * What a restore brought back and what it did not, from the kernel status or
 * the `restored` event: its shortfall, its summary in the server's words, and
 * what to do.
 */
import { IGpuFracEvent, IRestore } from './api';
import { formatBytes } from './memory';
import { defaultTrans, ITrans } from './trans';
import { capitalize, cellLabel, cutList, nameList } from './words';

/** What a restore brought back, from the kernel status or the `restored` event. */
export interface IRestoreFacts {
  ok?: boolean;
  restored?: string[];
  lost?: string[];
  lost_reasons?: Record<string, string>;
  /** Kept on disk for lack of room on the GPU: name to bytes. */
  deferred?: Record<string, number>;
  interrupted_cell?: string | null;
  error?: string | null;
}

export function restoreFactsOf(
  source: IRestore | IGpuFracEvent
): IRestoreFacts {
  return {
    ok: source.ok,
    restored: source.restored ?? [],
    lost: source.lost ?? [],
    lost_reasons: 'lost_reasons' in source ? source.lost_reasons : undefined,
    deferred: source.deferred ?? {},
    interrupted_cell: source.interrupted_cell ?? null,
    error: 'error' in source ? source.error : null
  };
}

/**
 * What an incomplete restore did not bring back, in a few words each, most
 * important first: ["2 variables lost", "1 on disk", "1 cell cut off"];
 * ["not verified"] when the kernel said nothing.
 */
export function restoreShortfall(
  facts: IRestoreFacts,
  trans: ITrans = defaultTrans
): string[] {
  if (unreported(facts)) {
    return [trans.__('not verified')];
  }
  const parts: string[] = [];
  const lost = (facts.lost ?? []).length;
  if (lost) {
    parts.push(trans._n('%1 variable lost', '%1 variables lost', lost));
  }
  const deferred = deferredNames(facts).length;
  if (deferred) {
    parts.push(trans.__('%1 on disk', deferred));
  }
  if (facts.interrupted_cell) {
    parts.push(trans.__('1 cell cut off'));
  }
  return parts.length ? parts : [trans.__('not verified')];
}

/** Whether nothing was said about what came back (no report, or an error). */
export function unreported(facts: IRestoreFacts): boolean {
  return (
    !!facts.error ||
    (facts.ok !== true &&
      !(facts.restored ?? []).length &&
      !(facts.lost ?? []).length &&
      !deferredNames(facts).length &&
      !facts.interrupted_cell)
  );
}

export function deferredNames(facts: IRestoreFacts): string[] {
  return Object.keys(facts.deferred ?? {}).sort();
}

/** "big (900.0 MiB), x (1.0 GiB)": what waits on disk, with sizes. */
export function deferredList(
  facts: IRestoreFacts,
  max: number,
  trans: ITrans
): string {
  const names = deferredNames(facts);
  const shown = names
    .slice(0, Math.max(1, max))
    .map(name => `${name} (${formatBytes(facts.deferred?.[name])})`);
  return cutList(shown, names.length, trans);
}

export interface ISummaryOptions {
  /** Most lost names to list (default all). */
  maxNames?: number;
  /** Most characters of the cut-off cell (default all). */
  cellChars?: number;
  /** Each lost name with why it was lost (lost_reasons), where there is room. */
  reasons?: boolean;
  /** Say what to do: re-run the cell and the cells that create the lost names. */
  advice?: boolean;
}

/**
 * In the server's words: "2 of 3 variables restored; lost: gen — re-run the
 * cells that create it; cell [7] train() was cut off: re-run it".
 */
export function restoreSummary(
  facts: IRestoreFacts,
  options: ISummaryOptions = {},
  trans: ITrans = defaultTrans
): string {
  const { maxNames = Infinity, cellChars = Infinity, advice = true } = options;
  const restored = facts.restored ?? [];
  const lost = facts.lost ?? [];
  const parts: string[] = [];
  if (facts.error) {
    parts.push(trans.__('no variables were restored: %1', facts.error));
  } else if (unreported(facts)) {
    parts.push(trans.__('the kernel did not report what came back'));
  } else {
    const total = restored.length + lost.length + deferredNames(facts).length;
    parts.push(
      trans._n(
        '%2 of %1 variable restored',
        '%2 of %1 variables restored',
        total,
        restored.length
      )
    );
  }
  if (deferredNames(facts).length) {
    const list = deferredList(facts, maxNames, trans);
    parts.push(
      advice
        ? trans.__(
            'kept on disk until there is room on the GPU: %1 — %gpu restore loads them',
            list
          )
        : trans.__('kept on disk until there is room on the GPU: %1', list)
    );
  }
  if (lost.length) {
    const shown = lost.slice(0, Math.max(1, maxNames)).map(name => {
      const why = options.reasons ? facts.lost_reasons?.[name] : undefined;
      return why ? trans.__('%1 (%2)', name, why) : name;
    });
    const list = cutList(shown, lost.length, trans);
    parts.push(
      advice
        ? trans._n(
            'lost: %2 — re-run the cells that create it',
            'lost: %2 — re-run the cells that create them',
            lost.length,
            list
          )
        : trans.__('lost: %1', list)
    );
  }
  if (facts.interrupted_cell) {
    const cell = cellLabel(facts.interrupted_cell, cellChars);
    parts.push(
      advice
        ? trans.__('cell %1 was cut off: re-run it', cell)
        : trans.__('cell %1 was cut off', cell)
    );
  }
  if (advice && unreported(facts)) {
    parts.push(trans.__('run %gpu in the notebook to see what it holds'));
  }
  return parts.join('; ');
}

/** What to do after a restore, or '' when nothing is to be done. */
export function restoreAdvice(
  facts: IRestoreFacts,
  trans: ITrans = defaultTrans
): string {
  const todo: string[] = [];
  if (facts.interrupted_cell) {
    todo.push(trans.__('re-run cell %1', cellLabel(facts.interrupted_cell)));
  }
  const lost = facts.lost ?? [];
  if (lost.length) {
    todo.push(
      trans._n(
        're-run the cell that creates %2',
        're-run the cells that create %2',
        lost.length,
        nameList(lost, Infinity, trans)
      )
    );
  }
  if (deferredNames(facts).length) {
    todo.push(
      trans.__(
        'run %gpu restore once there is room on the GPU to load %1',
        nameList(deferredNames(facts), Infinity, trans)
      )
    );
  }
  if (unreported(facts)) {
    todo.push(trans.__('run %gpu in the notebook to see what it holds'));
  }
  if (!todo.length) {
    return '';
  }
  return `${capitalize(todo.join(trans.__(', then ')))}.`;
}
