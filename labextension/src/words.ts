/**
 * Words fitted to their room: a text cut at a word, lists of names, a
 * notebook's and a cell's short names.
 */
import { defaultTrans, ITrans } from './trans';

/**
 * Shorten to at most `max` characters at a word boundary, with "…". A single
 * word longer than that is the only thing ever cut inside.
 */
export function fitWords(text: string, max: number): string {
  const clean = text.replace(/\s+/g, ' ').trim();
  if (clean.length <= max) {
    return clean;
  }
  const room = clean.slice(0, Math.max(0, max - 1));
  const space = room.lastIndexOf(' ');
  const cut = space > max / 3 ? room.slice(0, space) : room;
  return `${cut.replace(/[\s,;:—–-]+$/, '')}…`;
}

/** "train.ipynb" from "work/train.ipynb"; long names keep their start. */
export function notebookName(path: string | null | undefined): string {
  if (!path) {
    return '';
  }
  const name = path.split('/').pop() ?? path;
  return name.length > 40 ? `${name.slice(0, 39)}…` : name;
}

/** "a, b and c"; past `max` names: "a, b and 3 more". */
export function nameList(
  names: string[],
  max = Infinity,
  trans: ITrans = defaultTrans
): string {
  const shown = names.slice(0, Math.max(1, max));
  const more = names.length - shown.length;
  if (more > 0) {
    return trans.__('%1 and %2 more', shown.join(', '), more);
  }
  if (shown.length <= 1) {
    return shown.join('');
  }
  return trans.__(
    '%1 and %2',
    shown.slice(0, -1).join(', '),
    shown[shown.length - 1]
  );
}

/** "a, b" or "a, b and 3 more": a list that was already cut to `shown`. */
export function cutList(shown: string[], total: number, trans: ITrans): string {
  const more = total - shown.length;
  return more > 0
    ? trans.__('%1 and %2 more', shown.join(', '), more)
    : shown.join(', ');
}

/** "[7] for epoch in…": the cell's number stays, its first line is shortened. */
export function cellLabel(cell: string, max = Infinity): string {
  return max === Infinity ? cell.trim() : fitWords(cell, max);
}

export function capitalize(text: string): string {
  return `${text.charAt(0).toUpperCase()}${text.slice(1)}`;
}

/**
 * The server's and the agent's sentences mark commands as Markdown code
 * (`%gpu park`): a plain-text room (a notification, a tooltip) shows them
 * without the backticks.
 */
export function plainText(text: string): string {
  return text.replace(/`([^`\n]+)`/g, '$1');
}

/** A sentence in pieces, each a command (`code`) or not, for a room that can show code. */
export interface ITextPiece {
  text: string;
  code: boolean;
}

export function codePieces(text: string): ITextPiece[] {
  const pieces: ITextPiece[] = [];
  let at = 0;
  for (const match of text.matchAll(/`([^`\n]+)`/g)) {
    const start = match.index ?? 0;
    if (start > at) {
      pieces.push({ text: text.slice(at, start), code: false });
    }
    pieces.push({ text: match[1], code: true });
    at = start + match[0].length;
  }
  if (at < text.length) {
    pieces.push({ text: text.slice(at), code: false });
  }
  return pieces;
}
